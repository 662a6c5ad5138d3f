#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target: tests/fuzz/corpus/<target>/seed-*.

Valid inputs, and near-valid ones (one field wrong, truncated, corrupted), so the fuzzer
starts from the shapes the parsers accept. Deterministic: rerunning it rewrites the same
files. It replaces only seed-* files; regression inputs (regress-*, kept from crashes the
fuzzers found) are never touched. JPEG seeds come from make_jpeg_seeds.c (needs cc and
libjpeg); everything else is built here with the standard library.

Usage: tests/fuzz/seeds/make_corpus.py [CORPUS_DIR]   (default: tests/fuzz/corpus)
"""
import base64
import json
import os
import pathlib
import struct
import subprocess
import sys
import tempfile
import zlib

HERE = pathlib.Path(__file__).resolve().parent
CORPUS = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent / "corpus"


def write_seeds(target, seeds):
    out = CORPUS / target
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("seed-*"):
        old.unlink()
    for name, data in seeds:
        if isinstance(data, str):
            data = data.encode()
        assert len(data) < 64 * 1024, (target, name, len(data))
        (out / f"seed-{name}").write_bytes(data)
    print(f"{target}: {len(seeds)} seeds")


def dumps(value):
    return json.dumps(value, separators=(",", ":"))


# ---- PNG ------------------------------------------------------------------------------

def png_chunk(kind, body):
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_pixels(width, height, channels, depth, seed):
    """Rows of samples, each value in range for `depth` bits."""
    top = (1 << depth) - 1
    return [[(x * 37 + y * 11 + c * 71 + seed) % (top + 1) for x in range(width) for c in range(channels)]
            for y in range(height)]


def pack_row(samples, depth):
    if depth == 16:
        return b"".join(struct.pack(">H", s) for s in samples)
    if depth == 8:
        return bytes(samples)
    out, acc, bits = bytearray(), 0, 0
    for s in samples:
        acc = (acc << depth) | s
        bits += depth
        if bits == 8:
            out.append(acc)
            acc, bits = 0, 0
    if bits:
        out.append(acc << (8 - bits))
    return bytes(out)


def filter_row(row, prev, bpp, kind):
    out = bytearray([kind])
    for i, v in enumerate(row):
        a = row[i - bpp] if i >= bpp else 0
        b = prev[i] if prev else 0
        c = prev[i - bpp] if prev and i >= bpp else 0
        if kind == 0:
            p = 0
        elif kind == 1:
            p = a
        elif kind == 2:
            p = b
        elif kind == 3:
            p = (a + b) // 2
        else:
            pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
            p = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
        out.append((v - p) & 0xFF)
    return bytes(out)


ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]


def png(width, height, color_type, depth, seed=0, interlace=False, extra=(), idat_split=1,
        palette_size=0):
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color_type]
    rows = png_pixels(width, height, channels, depth, seed)
    bpp = max(1, channels * depth // 8)

    def encode(sub_rows):
        raw, prev = bytearray(), None
        for y, row in enumerate(sub_rows):
            packed = pack_row(row, depth)
            raw += filter_row(packed, prev, bpp, (y + seed) % 5)
            prev = packed
        return bytes(raw)

    if interlace:
        raw = bytearray()
        for x0, y0, dx, dy in ADAM7:
            sub = [[rows[y][x * channels + c] for x in range(x0, width, dx) for c in range(channels)]
                   for y in range(y0, height, dy)]
            if sub and sub[0]:
                raw += encode(sub)
        raw = bytes(raw)
    else:
        raw = encode(rows)
    data = zlib.compress(raw, 9)
    out = b"\x89PNG\r\n\x1a\n"
    out += png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, color_type, 0, 0,
                                          1 if interlace else 0))
    for kind, body in extra:
        out += png_chunk(kind, body)
    if color_type == 3:
        n = palette_size or (1 << depth)
        out += png_chunk(b"PLTE", bytes((i * 53 + k * 90) % 256 for i in range(n) for k in range(3)))
    step = max(1, -(-len(data) // idat_split))
    for i in range(0, len(data), step):
        out += png_chunk(b"IDAT", data[i:i + step])
    out += png_chunk(b"IEND", b"")
    return out


def png_with_ihdr(width, height, depth=8, color_type=2):
    """A PNG whose header claims another size than its (tiny) data."""
    base = png(2, 2, 2, 8)
    ihdr = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, color_type, 0, 0, 0))
    return base[:8] + ihdr + base[8 + 25:]


def png_seeds():
    s = []
    for depth in (1, 2, 4, 8, 16):
        s.append((f"gray{depth}-13x7.png", png(13, 7, 0, depth, seed=depth)))
    s.append(("rgb8-16x16.png", png(16, 16, 2, 8)))
    s.append(("rgb16-5x9.png", png(5, 9, 2, 16, seed=3)))
    s.append(("rgba8-8x8.png", png(8, 8, 6, 8, seed=4)))
    s.append(("rgba16-3x3.png", png(3, 3, 6, 16, seed=5)))
    s.append(("graya8-7x5.png", png(7, 5, 4, 8, seed=6)))
    s.append(("graya16-4x4.png", png(4, 4, 4, 16, seed=7)))
    for depth in (1, 2, 4, 8):
        s.append((f"palette{depth}-9x6.png", png(9, 6, 3, depth, seed=depth)))
    s.append(("palette8-trns-8x8.png", png(8, 8, 3, 8, extra=[(b"tRNS", bytes(range(0, 256, 16)))])))
    s.append(("palette4-short-plte.png", png(6, 6, 3, 4, palette_size=5)))
    s.append(("gray8-trns-6x6.png", png(6, 6, 0, 8, extra=[(b"tRNS", struct.pack(">H", 7))])))
    s.append(("rgb8-trns-6x6.png", png(6, 6, 2, 8, extra=[(b"tRNS", struct.pack(">HHH", 1, 2, 3))])))
    s.append(("rgb8-interlaced-11x9.png", png(11, 9, 2, 8, interlace=True)))
    s.append(("gray2-interlaced-10x10.png", png(10, 10, 0, 2, interlace=True)))
    s.append(("rgba16-interlaced-9x3.png", png(9, 3, 6, 16, interlace=True)))
    s.append(("rgb8-1x1.png", png(1, 1, 2, 8)))
    s.append(("rgb8-split-idat.png", png(12, 12, 2, 8, idat_split=4)))
    s.append(("rgb8-ancillary.png", png(6, 4, 2, 8, extra=[
        (b"gAMA", struct.pack(">I", 45455)),
        (b"cHRM", struct.pack(">8I", 31270, 32900, 64000, 33000, 30000, 60000, 15000, 6000)),
        (b"sRGB", b"\x00"), (b"bKGD", struct.pack(">HHH", 10, 20, 30)),
        (b"tEXt", b"Comment\x00fuzz seed"), (b"pHYs", struct.pack(">IIB", 2835, 2835, 1))])))
    s.append(("rgb8-gama-zero.png", png(4, 4, 2, 8, extra=[(b"gAMA", struct.pack(">I", 0))])))
    s.append(("rgb8-unknown-critical-chunk.png", png(4, 4, 2, 8, extra=[(b"ABCD", b"xyz")])))
    # Near-valid: corrupted and truncated copies.
    good = png(16, 16, 2, 8, seed=9)
    s.append(("truncated-in-idat.png", good[:len(good) // 2]))
    s.append(("truncated-after-ihdr.png", good[:33]))
    s.append(("signature-only.png", good[:8]))
    s.append(("no-iend.png", good[:-12]))
    bad_crc = bytearray(good)
    bad_crc[29] ^= 0xFF
    s.append(("bad-ihdr-crc.png", bytes(bad_crc)))
    bad_data = bytearray(good)
    bad_data[60] ^= 0x55
    s.append(("corrupt-idat.png", bytes(bad_data)))
    s.append(("zero-width.png", png_with_ihdr(0, 4)))
    s.append(("over-pixel-limit-5000x5000.png", png_with_ihdr(5000, 5000)))
    s.append(("at-pixel-limit-4096x4096.png", png_with_ihdr(4096, 4096)))
    s.append(("huge-dims-2g.png", png_with_ihdr(0x7FFFFFFF, 0x7FFFFFFF)))
    s.append(("bad-depth.png", png_with_ihdr(2, 2, depth=7)))
    s.append(("bad-color-type.png", png_with_ihdr(2, 2, color_type=5)))
    return s


# ---- JPEG -----------------------------------------------------------------------------

def jpeg_seeds():
    with tempfile.TemporaryDirectory() as tmp:
        tool = os.path.join(tmp, "make_jpeg_seeds")
        subprocess.run(["cc", "-O1", "-o", tool, str(HERE / "make_jpeg_seeds.c"), "-ljpeg"],
                       check=True)
        subprocess.run([tool, tmp], check=True)
        files = sorted(p for p in pathlib.Path(tmp).glob("seed-*.jpg"))
        s = [(p.name[len("seed-"):], p.read_bytes()) for p in files]
    good = dict(s)["baseline-16x16.jpg"]
    prog = dict(s)["progressive-32x24.jpg"]
    s.append(("truncated-half.jpg", good[:len(good) // 2]))
    s.append(("truncated-headers.jpg", good[:200]))
    s.append(("soi-only.jpg", good[:3]))
    s.append(("progressive-truncated.jpg", prog[:len(prog) * 2 // 3]))
    corrupt = bytearray(good)
    for i in range(len(corrupt) - 200, len(corrupt) - 2, 17):
        corrupt[i] ^= 0x5A
    s.append(("corrupt-scan.jpg", bytes(corrupt)))
    # The SOF0 frame claims other dimensions than the scan holds.
    sof = good.index(b"\xff\xc0")
    for name, w, h in (("sof-0x16.jpg", 0, 16), ("sof-5000x5000.jpg", 5000, 5000),
                       ("sof-4096x4096.jpg", 4096, 4096), ("sof-65535x1.jpg", 65535, 1)):
        patched = bytearray(good)
        patched[sof + 5:sof + 9] = struct.pack(">HH", h, w)
        s.append((name, bytes(patched)))
    no_eoi = good[:-2]
    s.append(("no-eoi.jpg", no_eoi))
    return s


# ---- agent wire frames ----------------------------------------------------------------

MAGIC = 0x31584345
TYPES = dict(HELLO=1, HELLO_OK=2, READ=3, READ_DATA=4, WRITE=5, WRITE_ACK=6, REGION_QUERY=7,
             REGION_INFO=8, CALL=9, CALL_REPLY=10, NOTIFY=11, ERROR=12)


def frame(kind, payload=b"", status=0, region=0, req_id=1, offset=0, length=0, flags=0,
          magic=MAGIC, payload_length=None):
    if isinstance(payload, str):
        payload = payload.encode()
    kind = TYPES.get(kind, kind)
    plen = len(payload) if payload_length is None else payload_length
    return struct.pack("<IHHIIQQQII", magic, kind, flags, status, region, req_id, offset, length,
                       plen, 0) + payload


def metadata(name="e-0", regions=None, **over):
    m = {"name": name, "protocol_version": 1, "compat_hash": "ecx-tiny-vl/bf16",
         "host_id": "0b5e7c1e-boot/host-a",
         "endpoints": {"shm": "ecx-agent-e-0-1234", "tcp": "127.0.0.1:40123"},
         "regions": regions if regions is not None else [
             {"id": 1, "length": 67108864, "kind": "host", "remote_write": False, "shareable": True},
             {"id": 2, "length": 4096, "kind": "cuda", "remote_write": True, "shareable": False}]}
    m.update(over)
    return dumps({k: v for k, v in m.items() if v is not None})


def wire_seeds():
    plain, fd_slot, attach, both = b"\x00", b"\x01", b"\x02", b"\x03"
    call = dumps({"op": "lookup", "mm_hash": "abc123", "pin": True})
    s = [
        ("hello", plain + frame("HELLO", metadata())),
        ("hello-ok-fd-slot", fd_slot + frame("HELLO_OK", metadata(name="pd-0"))),
        ("read", plain + frame("READ", region=1, offset=4096, length=1 << 20)),
        ("read-data-with-bytes", plain + frame("READ_DATA", length=16) + bytes(range(16))),
        ("write-with-bytes", plain + frame("WRITE", region=2, length=8) + b"ABCDEFGH"),
        ("write-ack", plain + frame("WRITE_ACK", req_id=77)),
        ("region-query", fd_slot + frame("REGION_QUERY", region=1)),
        ("region-info-fd", both + frame("REGION_INFO", region=1, length=65536, flags=7)),
        ("region-info-unexpected-fd", attach + frame("REGION_INFO", region=3, length=4096, flags=2)),
        ("call", plain + frame("CALL", call)),
        ("call-reply", plain + frame("CALL_REPLY", dumps({"ok": True, "items": []}))),
        ("notify", plain + frame("NOTIFY", dumps({"op": "release", "pins": [1, 2, 3]}))),
        ("error-not-found", plain + frame("ERROR", "mm_hash abc123 is not here", status=2)),
        ("error-status-zero", plain + frame("ERROR", "no code", status=0)),
        ("error-status-huge", plain + frame("ERROR", "bad code", status=0xFFFFFFFF)),
        ("unknown-type", plain + frame(999, "??")),
        ("stream-of-frames", plain + frame("HELLO", metadata()) + frame("READ", region=1, length=64)
         + frame("CALL", call) + frame("NOTIFY", "{}") + frame("ERROR", "bye", status=7)),
        ("bad-magic", plain + frame("HELLO", metadata(), magic=0x31584346)),
        ("truncated-header", plain + frame("READ")[:30]),
        ("truncated-payload", plain + frame("CALL", call)[:60]),
        ("payload-over-limit", plain + frame("CALL", payload_length=16 * 1024 * 1024 + 1)),
        ("payload-at-limit-no-bytes", plain + frame("CALL", payload_length=16 * 1024 * 1024)),
        ("hello-bad-metadata", plain + frame("HELLO", "{\"name\":5}")),
        ("empty-stream", plain),
    ]
    return s


# ---- agent metadata -------------------------------------------------------------------

def metadata_seeds():
    region = {"id": 1, "length": 4096, "kind": "host"}
    s = [
        ("valid", metadata()),
        ("valid-no-regions", metadata(regions=[])),
        ("valid-minimal", dumps({"name": "a", "protocol_version": 0, "compat_hash": "",
                                 "endpoints": {}, "regions": []})),
        ("valid-unicode-name", metadata(name="\u00e9ncoder-\u4e00")),
        ("valid-escaped", '{"name":"e\\u0030","protocol_version":1,"compat_hash":"x\\n",'
                          '"endpoints":{"tcp":"[::1]:5000"},"regions":[]}'),
        ("missing-name", metadata(name=None)),
        ("empty-name", metadata(name="")),
        ("name-too-long", metadata(name="n" * 300)),
        ("version-negative", metadata(protocol_version=-1)),
        ("version-too-big", metadata(protocol_version=1 << 33)),
        ("version-float", metadata(protocol_version=1.5)),
        ("version-string", metadata(protocol_version="1")),
        ("endpoints-array", metadata(endpoints=["a"])),
        ("shm-too-long", metadata(endpoints={"shm": "s" * 108})),
        ("region-kind-unknown", metadata(regions=[dict(region, kind="disk")])),
        ("region-length-too-big", metadata(regions=[dict(region, length=1 << 49)])),
        ("region-id-too-big", metadata(regions=[dict(region, id=1 << 32)])),
        ("region-not-object", metadata(regions=[1, 2])),
        ("region-flags-not-bool", metadata(regions=[dict(region, remote_write=1, shareable="yes")])),
        ("regions-many", metadata(regions=[dict(region, id=i) for i in range(200)])),
        ("not-object", "[1,2,3]"),
        ("not-json", "{\"name\": \"e-0\","),
        ("empty", ""),
        ("deep-nesting", "{\"name\":\"a\",\"x\":" + "[" * 5000 + "]" * 5000 + "}"),
        ("duplicate-keys", '{"name":"a","name":"b","protocol_version":1,"compat_hash":"",'
                           '"endpoints":{},"regions":[]}'),
        ("invalid-utf8", b'{"name":"\xff\xfe","protocol_version":1,"compat_hash":"","endpoints":{},'
                         b'"regions":[]}'),
    ]
    return s


# ---- ec_transfer_params ---------------------------------------------------------------

MM_HASH = "3f1a9c0d5e7b2a4c6e8f0a1b3c5d7e9f1a2b3c4d5e6f708192a3b4c5d6e7f809"


def params(**over):
    p = {"connector": "p2p", "mode": "pull", "engine_id": "e-0", "agent": metadata(),
         "compat_hash": "ecx-tiny-vl/bf16", "mm_hash": MM_HASH, "dtype": "BF16",
         "shape": [400, 2048], "num_tokens": 400, "region": 1, "offset": 4096,
         "length": 1638464, "generation": 7, "pin": 12}
    for k, v in over.items():
        if v is None:
            p.pop(k, None)
        else:
            p[k] = v
    return dumps(p)


def params_seeds():
    no_location = dict(region=None, offset=None, length=None, generation=None, pin=None)
    s = [
        ("p2p-pull", params()),
        ("p2p-push", params(mode="push")),
        ("p2p-pull-2step-no-location", params(mode="pull-2step", **no_location)),
        ("disk", params(connector="disk", mode=None, agent=None, **no_location)),
        ("store", params(connector="store", mode=None, agent=None, **no_location)),
        ("region-zero-with-offset", params(region=0)),
        ("dtypes-f32-3d", params(dtype="F32", shape=[2, 3, 4])),
        ("dtype-i64-scalar", params(dtype="I64", shape=[])),
        ("dtype-unknown", params(dtype="F64")),
        ("shape-negative", params(shape=[-1, 2048])),
        ("shape-overflow", params(shape=[1 << 40, 1 << 20])),
        ("shape-rank-9", params(shape=[1] * 9)),
        ("shape-float", params(shape=[400.0, 2048])),
        ("mm-hash-bad-chars", params(mm_hash="../etc/passwd")),
        ("mm-hash-empty", params(mm_hash="")),
        ("mm-hash-missing", params(mm_hash=None)),
        ("connector-missing", params(connector=None)),
        ("connector-too-long", params(connector="p" * 40)),
        ("num-tokens-too-big", params(num_tokens=(1 << 32) + 1)),
        ("offset-negative", params(offset=-5)),
        ("generation-max", params(generation=(1 << 64) - 1)),
        ("generation-over-max", params(generation=1 << 64)),
        ("region-too-big", params(region=1 << 32)),
        ("pin-string", params(pin="12")),
        ("not-object", dumps([params()])),
        ("not-json", params()[:-7]),
    ]
    return s


# ---- chat completion requests ---------------------------------------------------------

def chat(messages=None, **over):
    body = {"model": "ecx-tiny-vl", "max_tokens": 16,
            "messages": messages if messages is not None else [
                {"role": "user", "content": "Describe the picture."}]}
    for k, v in over.items():
        if v is None:
            body.pop(k, None)
        else:
            body[k] = v
    return dumps(body)


def nested(arrays):
    """A valid request whose extra field "x" holds `arrays` nested arrays."""
    return chat()[:-1] + ',"x":' + "[" * arrays + "]" * arrays + "}"


def chat_seeds():
    tiny = base64.b64encode(png(2, 2, 2, 8)).decode()
    url = "data:image/png;base64," + tiny

    def image_part(u=url, as_object=True):
        return {"type": "image_url", "image_url": {"url": u} if as_object else u}

    def with_parts(*parts):
        return [{"role": "user", "content": list(parts)}]

    text = {"type": "text", "text": "What is this?"}
    s = [
        ("text-only", chat()),
        ("system-user-assistant", chat([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello"}])),
        ("image-and-text", chat(with_parts(text, image_part()))),
        ("image-url-as-string", chat(with_parts(image_part(as_object=False), text))),
        ("two-images", chat(with_parts(image_part(), image_part(), text))),
        ("stream-with-usage", chat(stream=True, stream_options={"include_usage": True})),
        ("max-completion-tokens", chat(max_tokens=None, max_completion_tokens=64, ignore_eos=True)),
        ("ec-transfer-params", chat(with_parts(image_part()),
                                    ec_transfer_params={MM_HASH: json.loads(params())})),
        ("max-tokens-zero", chat(max_tokens=0)),
        ("max-tokens-over-limit", chat(max_tokens=4097)),
        ("max-tokens-float", chat(max_tokens=1.5)),
        ("max-tokens-huge-unsigned", chat(max_tokens=(1 << 64) - 1)),
        ("wrong-model", chat(model="gpt-4o")),
        ("model-missing", chat(model=None)),
        ("messages-empty", chat([])),
        ("role-unknown", chat([{"role": "tool", "content": "x"}])),
        ("content-null", chat([{"role": "user", "content": None}])),
        ("part-type-unknown", chat(with_parts({"type": "audio", "audio": "x"}))),
        ("image-remote-url", chat(with_parts(image_part("http://example.com/a.png")))),
        ("image-local-file", chat(with_parts(image_part("file:///etc/passwd")))),
        ("image-bad-base64", chat(with_parts(image_part("data:image/png;base64,abc!")))),
        ("image-not-base64", chat(with_parts(image_part("data:image/png,rawbytes")))),
        ("image-wrong-mime", chat(with_parts(image_part("data:text/plain;base64," + tiny)))),
        ("nine-images", chat(with_parts(*[image_part()] * 9))),
        ("stream-not-bool", chat(stream="yes")),
        ("ec-transfer-params-array", chat(ec_transfer_params=[1])),
        ("nesting-64", nested(63)),
        ("nesting-65", nested(64)),
        ("brackets-in-strings", chat([{"role": "user", "content": "[[[[{{{{\\\"]]]"}])),
        ("not-object", dumps([chat()])),
        ("not-json", chat()[:-3]),
    ]
    return s


def main():
    write_seeds("wire_frame", wire_seeds())
    write_seeds("agent_metadata", metadata_seeds())
    write_seeds("ec_transfer_params", params_seeds())
    write_seeds("chat_request", chat_seeds())
    write_seeds("png_decode", png_seeds())
    write_seeds("jpeg_decode", jpeg_seeds())


if __name__ == "__main__":
    main()
