"""A producer process for the package tests: an ecx p2p producer connector that saves
items on request. Line protocol on stdin/stdout:
    save <mm_hash> <dtype> <d0,d1,...> <seed>   -> params JSON (payload: bytes from seed)
    stats                                        -> stats JSON
    quit
"""
import json
import sys

import numpy as np

import ecx


def payload(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def main() -> None:
    config = sys.argv[1]
    conn = ecx.Connector(config)
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        try:
            if words[0] == "save":
                mm_hash, dtype, dims, seed = words[1], words[2], words[3], int(words[4])
                shape = [int(d) for d in dims.split(",")]
                size = int(np.prod(shape)) * {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}[dtype]
                print(conn.save(mm_hash, dtype, shape, payload(seed, size)), flush=True)
            elif words[0] == "stats":
                print(json.dumps(conn.stats()), flush=True)
        except ecx.Error as e:
            print(json.dumps({"error": e.code, "message": e.message}), flush=True)


if __name__ == "__main__":
    main()
