"""A flame graph of `perf script` output, as PNG (Pillow), for docs/.

    perf record -o perf.data --call-graph dwarf,16384 -F 4000 -- build/ecx bench transfer ...
    perf script -i perf.data | .venv/bin/python bench/python/flamegraph.py \
        --root 'Connector::load' --title '...' --out docs/results/flame.png

Only the stacks through a frame whose name ends with --root are drawn, from that frame up: the
width of a box is its share of the samples under the root.
"""

import argparse
import collections
import re
import sys

from PIL import Image, ImageDraw, ImageFont

ROW = 18
WIDTH = 1600


def stacks(lines):
    """(frames root first, 1) per sample of `perf script` output."""
    frames = []
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            if frames:
                yield list(reversed(frames))
            frames = []
        elif line.startswith(("\t", " ")):
            parts = line.strip().split(" ", 1)
            symbol = parts[1] if len(parts) > 1 else parts[0]
            frames.append(re.sub(r"\s*\([^()]*\)$", "", symbol))
    if frames:
        yield list(reversed(frames))


def short(symbol):
    """A frame name without templates, arguments and namespaces ecx::."""
    symbol = re.sub(r"\+0x[0-9a-f]+$", "", symbol).replace("(anonymous namespace)::", "")
    while "<" in symbol and re.search(r"<[^<>]*>", symbol):
        symbol = re.sub(r"<[^<>]*>", "", symbol)
    symbol = re.sub(r"\(.*\)", "", symbol)
    return symbol.replace("(anonymous namespace)::", "").replace("ecx::", "")


def tree(samples, root):
    counts = collections.Counter()
    total = 0
    for frames in samples:
        at = next((i for i, f in enumerate(frames) if short(f).endswith(root)), None)
        if at is None:
            continue
        path = tuple(short(f) for f in frames[at:])
        total += 1
        for depth in range(1, len(path) + 1):
            counts[path[:depth]] += 1
    return counts, total


def draw(counts, total, title, out):
    depth = max(len(p) for p in counts)
    image = Image.new("RGB", (WIDTH, (depth + 2) * ROW), "white")
    pen = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    pen.text((4, 2), f"{title} ({total} samples)", fill="black", font=font)
    x_of = {(): 0.0}
    for path in sorted(counts, key=lambda p: (len(p), p)):
        parent = path[:-1]
        x = x_of.get(parent, 0.0)
        width = counts[path] / total * WIDTH
        x_of[parent] = x + width  # the next sibling starts after this one
        x_of[path] = x
        y = (len(path) + 1) * ROW
        shade = 200 - min(120, len(path) * 6)
        if width < 1:
            continue
        pen.rectangle([x, y, x + width - 1, y + ROW - 2], fill=(255, shade, 60), outline="white")
        label = f"{path[-1]} {100 * counts[path] / total:.0f}%"
        if width > 40:
            pen.text((x + 3, y + 3), label[: int(width / 6.5)], fill="black", font=font)
    image.save(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--title", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    counts, total = tree(stacks(sys.stdin), args.root)
    if not total:
        sys.exit(f"no stack passes through a frame ending with {args.root!r}")
    draw(counts, total, args.title, args.out)
    for path, n in sorted(counts.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{100 * n / total:5.1f}%  {' > '.join(path[-3:])}")


if __name__ == "__main__":
    main()
