// Drives the ecx proxy with the official OpenAI client library: one non-streaming and
// one streaming chat completion with an image, and an error. Prints a JSON summary;
// exits non-zero if anything is off.
import OpenAI from 'openai';
import fs from 'node:fs';

const [baseURL, imagePath] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: 'not-needed', maxRetries: 0, timeout: 120000 });
const image = 'data:image/png;base64,' + fs.readFileSync(imagePath).toString('base64');
const messages = [{
  role: 'user',
  content: [
    { type: 'text', text: 'What is in this picture?' },
    { type: 'image_url', image_url: { url: image } },
  ],
}];

const full = await client.chat.completions.create({
  model: 'ecx-tiny-vl', messages, max_tokens: 12, ignore_eos: true,
});
const text = full.choices[0].message.content;

let streamed = '';
let finish = null;
const stream = await client.chat.completions.create({
  model: 'ecx-tiny-vl', messages, max_tokens: 12, ignore_eos: true, stream: true,
});
for await (const chunk of stream) {
  streamed += chunk.choices[0]?.delta?.content ?? '';
  finish = chunk.choices[0]?.finish_reason ?? finish;
}

let errorStatus = 0;
let errorMessage = '';
try {
  await client.chat.completions.create({ model: 'no-such-model', messages });
} catch (e) {
  errorStatus = e.status;
  errorMessage = e.message;
}

const models = await client.models.list();
const summary = {
  text, streamed, finish, usage: full.usage, errorStatus, errorMessage,
  models: models.data.map((m) => m.id),
};
console.log(JSON.stringify(summary));
const ok = text.length === 12 && streamed === text && finish === 'length' &&
  full.usage.completion_tokens === 12 && errorStatus === 400 && summary.models.includes('ecx-tiny-vl');
process.exit(ok ? 0 : 1);
