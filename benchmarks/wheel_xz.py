"""A wheel carried as an xz-compressed tar of its files, and made a wheel again on the GPU machine.

A wheel is a zip whose members are each deflated: FlashAttention 4's CUDA-13 libraries wheel (nvidia-cutlass-dsl-libs-
cu13, 88 MiB, 226 MiB of shared libraries) packs to 59 MiB as one xz stream, which frees ~29 MiB of the two calls'
64 MiB each that lease 2 carries it in (docs/gpu-benchmarks.md), room the project's tree grows into.

    python3 benchmarks/wheel_xz.py pack WHEEL OUT.tar.xz      # where the wheels are downloaded (gpu_wheels.sh)
    python3 benchmarks/wheel_xz.py unpack IN.tar.xz FOLDER    # on the machine: FOLDER/<the wheel's own name>

`unpack` checks every file against the wheel's RECORD (each file's sha256 and size, as the wheel's builder wrote them)
and writes the wheel again with its members stored, not compressed (pip installs it in seconds); the tar.xz itself is
checked by the carry's SHA256SUMS before. Standard library only: the GPU machine's Python has nothing else to rely on.
"""

import base64
import csv
import hashlib
import io
import lzma
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

# The name the wheel had, kept inside the tar so that unpack writes the wheel pip reads its tags from
NAME_MEMBER = ".wheel-name"


def pack(wheel: Path, out: Path) -> None:
    """The wheel's members, in its own order, as one tar compressed with xz -9: by the `xz` program on every core where
    there is one (4 minutes for the 226 MiB on 2 cores), else by Python's lzma on one."""
    partial = out.with_name(out.name + ".partial")
    with open(partial, "wb") as sink:
        if shutil.which("xz"):
            xz = subprocess.Popen(["xz", "-9", "-T0", "-c"], stdin=subprocess.PIPE, stdout=sink)
            write_tar(wheel, xz.stdin)
            xz.stdin.close()
            if xz.wait():
                raise SystemExit(f"error: xz failed ({xz.returncode}) packing {wheel}")
        else:
            with lzma.open(sink, "wb", preset=9) as packed:
                write_tar(wheel, packed)
    partial.replace(out)


def write_tar(wheel: Path, sink) -> None:
    """The wheel's files, in its own order, as a tar streamed to `sink`, its name first."""
    with zipfile.ZipFile(wheel) as source, tarfile.open(fileobj=sink, mode="w|") as tar:
        add(tar, NAME_MEMBER, wheel.name.encode())
        for info in source.infolist():
            if not info.is_dir():
                add(tar, info.filename, source.read(info), mode=(info.external_attr >> 16) & 0o777 or 0o644)


def add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def unpack(packed: Path, folder: Path) -> Path:
    """The wheel again, in `folder`, after every file is checked against its RECORD; raises SystemExit saying which
    file differs (nothing is left behind then)."""
    digests, records, name = {}, {}, None
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / (packed.name + ".partial")
    with tarfile.open(packed, mode="r|xz") as tar, zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as wheel:
        for member in tar:
            data = tar.extractfile(member).read()
            if member.name == NAME_MEMBER:
                name = data.decode()
                continue
            digests[member.name] = (record_hash(data), len(data))
            if member.name.endswith(".dist-info/RECORD"):
                records[member.name] = data.decode()
            info = zipfile.ZipInfo(member.name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | member.mode) << 16
            wheel.writestr(info, data)
    try:
        check_record(digests, records, name)
    except SystemExit:
        partial.unlink()
        raise
    return partial.replace(folder / name)


def record_hash(data: bytes) -> str:
    """A file's hash as a wheel's RECORD writes it (PEP 376: urlsafe base64, no padding)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def check_record(digests: dict, records: dict[str, str], name: str | None) -> None:
    """Every file the RECORD lists is there with its hash and size, and no other (but the RECORD, listed unhashed)."""
    if name is None:
        raise SystemExit("error: not a packed wheel (no .wheel-name): pack it with benchmarks/wheel_xz.py")
    if len(records) != 1:
        raise SystemExit(f"error: {name}: {len(records)} RECORD files in the packed wheel: pack it again")
    rows = csv.reader(io.StringIO(next(iter(records.values()))))
    listed = {row[0]: (row[1], int(row[2])) for row in rows if row and row[1]}
    missing = sorted(set(listed) - set(digests))
    differ = sorted(m for m in listed.keys() & digests.keys() if listed[m] != digests[m])
    extra = sorted(set(digests) - set(listed) - set(records))
    if missing or differ or extra:
        what = "; ".join(
            f"{words}: {', '.join(names[:3])}"
            for words, names in (("missing", missing), ("differ from the RECORD", differ), ("not in it", extra))
            if names
        )
        raise SystemExit(f"error: {name}: its files do not match its RECORD ({what}): pack it again")


def main(argv: list[str]) -> int:
    usage = __doc__.strip().splitlines()[4:6]
    if len(argv) != 3 or argv[0] not in ("pack", "unpack"):
        print("usage:\n" + "\n".join(usage), file=sys.stderr)
        return 2
    if argv[0] == "pack":
        pack(Path(argv[1]), Path(argv[2]))
        return 0
    print(unpack(Path(argv[1]), Path(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
