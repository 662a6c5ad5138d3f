"""The repaired ecx wheel, installed in a fresh venv (tests/wheel/smoke): it imports from the
venv (not from a source tree), every library it loads beyond glibc and libstdc++/libgcc comes
from inside the wheel, and two agents move 1 MiB between them, compared byte by byte. numpy is not installed
(the wheel is installed without its dependencies): the bytes are bytearrays, reached
through the buffer protocol."""
import json
import os
import subprocess
from pathlib import Path

import ecx
import ecx._ecx as ext

SYSTEM = ("linux-vdso", "libc.so", "libm.so", "libdl.so", "libpthread.so", "librt.so",
          "ld-linux", "libstdc++.so", "libgcc_s.so")


def check_location() -> str:
    module = Path(ext.__file__).resolve()
    assert "site-packages" in module.parts, f"ecx imported from {module}, not from the venv"
    return str(module)


def check_libraries() -> list[str]:
    """What the extension links, as the loader resolves it (ldd): the wheel's own copies, or
    glibc and libstdc++/libgcc. Returns the wheel's."""
    module = Path(ext.__file__).resolve()
    wheel_root = module.parents[1]
    ldd = subprocess.run(["ldd", str(module)], check=True, capture_output=True, text=True).stdout
    bundled, foreign = [], []
    for line in ldd.splitlines():
        parts = line.split()
        if "not" in parts and "found" in parts:
            foreign.append(line.strip())
            continue
        if "=>" not in parts:
            continue  # the vdso and the loader itself
        path = parts[parts.index("=>") + 1]
        if path.startswith(str(wheel_root)):
            bundled.append(path)
        elif not Path(path).name.startswith(SYSTEM):
            foreign.append(path)
    assert not foreign, f"the extension links libraries from outside the wheel: {foreign}"
    assert bundled, "no library of the wheel's own: was it repaired?"
    return bundled


def round_trip() -> None:
    """Memory of this process (bytearrays, through the buffer protocol) registered with two
    agents; 1 MiB read from one into the other over tcp."""
    nbytes = 1 << 20
    owner, reader = ecx.Agent("wheel-owner"), ecx.Agent("wheel-reader")
    pattern = bytearray((i * 7 + 3) & 0xFF for i in range(nbytes))
    received = bytearray(nbytes)
    src, dst = owner.register_memory(pattern), reader.register_memory(received)
    backend = reader.connect(owner.metadata(), backend="tcp")  # registered memory: tcp
    reader.read("wheel-owner", [(dst.id, 0, src.id, 0, nbytes, "")]).wait(10000)
    assert received == pattern, "the bytes read differ from those written"
    print(f"round trip: 1 MiB over {backend}: identical")


if __name__ == "__main__":
    where = check_location()
    round_trip()
    inside = check_libraries()
    print(json.dumps({"module": where, "bundled": [os.path.basename(p) for p in inside]}))
