"""`pip install .` is a working install: the gRPC stubs (tandem/v1) are generated from proto/ here,
before setuptools collects the packages, so a wheel carries them (make proto does the same in place)."""

from pathlib import Path

from setuptools import setup


def generate_stubs() -> None:
    root = Path(__file__).resolve().parent
    protos = sorted(str(p.relative_to(root / "proto")) for p in (root / "proto" / "tandem" / "v1").glob("*.proto"))
    if not protos:
        return  # an sdist built from an installed tree: the stubs are already there
    from grpc_tools import protoc  # a build requirement (pyproject.toml [build-system])

    (root / "tandem" / "v1").mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{root / 'proto'}", f"-I{include}", f"--python_out={root}", f"--grpc_python_out={root}",
            f"--pyi_out={root}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("generating the gRPC stubs from proto/ failed")


generate_stubs()
setup()
