"""Every flag is also a TANDEM_* environment variable, defined once; `tandem` dispatches to the parts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.cli import env_settable
from router.__main__ import build_parser as router_parser
from router.__main__ import config_from_args


def parse(environ: dict[str, str], argv: list[str]):
    parser = router_parser()
    return env_settable(parser, environ).parse_args(argv)


BASE = ["--target", "t:1", "--tokenizer", "tok"]


def test_environment_sets_defaults_and_flags_win():
    args = parse({"TANDEM_MAX_NUM_SEQS": "7", "TANDEM_NUM_SPECULATIVE_TOKENS": "2", "TANDEM_NO_PIPELINE": "true"},
                 [*BASE, "--num-speculative-tokens", "3"])
    config = config_from_args(args)
    assert (config.max_num_seqs, config.k_max, config.pipeline) == (7, 3, False)


def test_required_flags_may_come_from_the_environment():
    args = parse({"TANDEM_TARGET": "a:1,b:2", "TANDEM_TOKENIZER": "/m"}, [])
    assert (args.target, args.tokenizer) == ("a:1,b:2", "/m")


def test_vllm_names_and_old_aliases_are_one_flag():
    assert parse({}, [*BASE, "--k-max", "5", "--http-port", "9"]).num_speculative_tokens == 5
    assert parse({}, [*BASE, "--port", "9"]).port == 9


@pytest.mark.parametrize("environ", [{"TANDEM_MAX_NUM_SEQS": "many"}, {"TANDEM_NO_PIPELINE": "maybe"}])
def test_a_bad_environment_value_is_refused_like_a_bad_flag(environ, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(environ, BASE)
    assert exit_.value.code == 2 and next(iter(environ)) in capsys.readouterr().err


def test_a_list_flag_takes_space_separated_values_from_the_environment():
    from target_service.__main__ import build_parser as target_parser

    parser = env_settable(target_parser(), {"TANDEM_LORA_MODULES": "sql=/a/sql  poet=/a/poet"})
    assert parser.parse_args(["--model", "m"]).lora_modules == ["sql=/a/sql", "poet=/a/poet"]
    assert parser.parse_args(["--model", "m", "--lora-modules", "x=/x"]).lora_modules == ["x=/x"]


def test_a_secret_from_the_environment_keeps_its_value_and_never_shows_it():
    import argparse

    from common.cli import Secret

    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key", type=Secret, default=None)
    key = env_settable(parser, {"TANDEM_API_KEY": "s3cret"}).parse_args([]).api_key
    assert isinstance(key, Secret) and key.encode() == b"s3cret" and key == "s3cret"
    assert "s3cret" not in repr(key) and "s3cret" not in str(key)


def test_help_names_the_variable():
    assert "TANDEM_MAX_NUM_BATCHED_TOKENS" in router_parser().format_help()


def test_tandem_console_script_lists_its_commands():
    out = subprocess.run([sys.executable, "-m", "common.cli"], capture_output=True, text=True)
    assert out.returncode == 2 and all(c in out.stdout for c in ("serve", "target", "draft", "router"))
    out = subprocess.run([sys.executable, "-c", "import sys; from common.cli import main; sys.exit(main(['router', "
                          "'--help']))"], capture_output=True, text=True)
    assert out.returncode == 0 and "tandem router" in out.stdout and "--num-speculative-tokens" in out.stdout


@pytest.mark.slow
def test_pip_install_builds_the_grpc_stubs(tmp_path):
    """`pip install .` is a working install: the wheel carries tandem/v1, generated at build time."""
    import shutil
    import zipfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"
    shutil.copytree(repo, src, ignore=shutil.ignore_patterns(".venv", "models", ".git", "*.egg-info", "__pycache__",
                                                             ".pytest_cache", ".hypothesis"))
    shutil.rmtree(src / "tandem")  # the stubs `make proto` generated here: the build must make its own
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                          str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("tandem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"tandem/v1/target_pb2.py", "tandem/v1/draft_pb2_grpc.py", "tandem/v1/generate_pb2.py"} <= names
    assert any(n.endswith("entry_points.txt") for n in names)


def test_lora_modules_are_checked_before_anything_loads(tmp_path, capsys):
    from target_service.__main__ import main as target_main

    ok = f"a={tmp_path}"
    for argv, says in ((["--lora-modules", "sql"], "NAME=DIR"), (["--lora-modules", f"{ok}/none"], "no directory"),
                       (["--lora-modules", ok, ok], "a name of its own"),
                       (["--lora-modules", ok, "--tensor-parallel-size", "2"], "one tensor-parallel rank"),
                       (["--enable-runtime-lora", "--tensor-parallel-size", "2"], "one tensor-parallel rank"),
                       (["--lora-modules", ok, "--max-loras", "0"], "fewer than the 1 --lora-modules")):
        with pytest.raises(SystemExit) as exit_:
            target_main(["--model", str(tmp_path), *argv])
        assert exit_.value.code == 2 and says in capsys.readouterr().err, argv


def test_a_chat_template_that_does_not_compile_stops_the_router_before_it_connects(tmp_path, capsys):
    from router.__main__ import main as router_main
    from tests.conftest import write_tokenizer

    write_tokenizer(tmp_path)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    for path, says in ((broken, "broken.jinja"), (tmp_path / "none.jinja", "No such file")):
        code = router_main(["--target", "127.0.0.1:1", "--tokenizer", str(tmp_path), "--chat-template", str(path)])
        assert code == 2 and says in capsys.readouterr().err


def test_tandem_serve_hands_the_router_its_own_flags():
    from router.launch import _parsers
    from router.launch import build_parser as serve_parser

    args = serve_parser("tandem serve").parse_args(["models/x", "--chat-template", "t.jinja", "--tool-call-parser",
                                                     "hermes"])
    assert _parsers(args) == ["--tool-call-parser=hermes", f"--chat-template={Path('t.jinja').resolve()}"]
    assert _parsers(serve_parser("tandem serve").parse_args(["models/x"])) == []
