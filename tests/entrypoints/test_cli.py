"""The `jaxserve` command line as vLLM's: `--x/--no-x` booleans, `-tp`, vLLM's flags, `--config`
(a YAML of flags), engine-argument help that says what each does, `--version`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from jaxserve.config import ENGINE_ARGS, EngineConfig
from jaxserve.entrypoints.cli.args import VLLM_FLAG_TYPES, engine_kwargs, parse_with_config
from jaxserve.entrypoints.cli.main import build_parser, main


def serve_kwargs(*flags: str) -> dict:
    return engine_kwargs(parse_with_config(build_parser(), ["serve", "m", *flags]),
                         skip=("model",))


def test_boolean_flags_take_vllms_no_form_and_short_flags_parse():
    assert serve_kwargs("--no-enable-prefix-caching", "--precompile", "-tp", "2") == {
        "enable_prefix_caching": False, "precompile": True, "tensor_parallel_size": 2}
    assert serve_kwargs("--enable-prefix-caching", "--no-async-scheduling") == {
        "enable_prefix_caching": True, "async_scheduling": False}


def test_vllms_flags_parse_and_reach_the_engine_config(tmp_path: Path):
    kwargs = serve_kwargs("--enforce-eager", "--disable-log-requests", "--trust-remote-code",
                          "--swap-space", "4", "--max-num-seqs", "8", "--data-parallel-size",
                          "2", "--generation-config", "vllm", "--kv-cache-dtype", "auto")
    config = EngineConfig.from_kwargs(model=str(tmp_path), **kwargs)
    assert (config.scheduler.max_num_seqs, config.parallel.data_parallel_size_local) == (8, 2)
    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        EngineConfig.from_kwargs(**serve_kwargs("--quantization", "awq"))
    assert config.model.generation_config == "vllm"
    with pytest.raises(ValueError, match="generation_config must be 'auto' or 'vllm'"):
        EngineConfig.from_kwargs(**serve_kwargs("--generation-config", "/some/dir"))
    with pytest.raises(ValueError, match="data_parallel_size .2. and data_parallel_size_local"):
        EngineConfig.from_kwargs(**serve_kwargs("-dp", "2", "--data-parallel-size-local", "1"))


def test_speculative_config_flag_takes_vllms_json(tmp_path: Path):
    kwargs = serve_kwargs("--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 3, '
                          '"prompt_lookup_max": 4}')
    spec = EngineConfig.from_kwargs(model=str(tmp_path), **kwargs).scheduler.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min,
            spec.prompt_lookup_max) == ("ngram", 3, 4, 4)
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        EngineConfig.from_kwargs(**serve_kwargs("--speculative-config", '{"method": "ngram"}'))


def test_config_yaml_gives_flags_that_the_command_line_overrides(tmp_path: Path):
    path = tmp_path / "flags.yaml"
    path.write_text("max-num-seqs: 8\nenable_prefix_caching: false\nport: 9001\n"
                    "token-buckets: [16, 64]\nmodel: /models/m\n")
    args = parse_with_config(build_parser(), ["serve", "--config", str(path),
                                              "--max-num-seqs", "4"])
    assert (args.model, args.port) == ("/models/m", 9001)
    assert engine_kwargs(args, skip=("model",)) == {
        "max_num_seqs": 4, "enable_prefix_caching": False, "token_buckets": [16, 64]}


def test_a_bad_config_file_is_an_error_naming_the_key(tmp_path: Path, capsys):
    path = tmp_path / "flags.yaml"
    path.write_text("max_num_seqs: 8\nmax_num_sequences: 4\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "'max_num_sequences' is not a flag of this command" in capsys.readouterr().err
    path.write_text("- a list\n")
    assert main(["generate", "x", "--config", str(path)]) == 2
    assert "must be a mapping" in capsys.readouterr().err


def _engine_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["serve"]._actions}


def test_every_engine_argument_has_help_that_says_what_it_does():
    actions = _engine_actions(build_parser())
    for name in [n for n in ENGINE_ARGS if n != "model"] + list(VLLM_FLAG_TYPES):
        text = actions[name].help
        assert text and not text.startswith("default") and len(text.split()) >= 4, name


WITH_ENGINE_ARGS = ("generate", "serve", "run-batch", "compile", "compile-check")


@pytest.mark.parametrize("command", [*WITH_ENGINE_ARGS, "convert", "run", "bench", "chat",
                                     "complete"])
def test_every_subcommand_prints_its_help(command, capsys):
    """argparse %-formats help texts: a bare % in one crashed `serve --help`."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    words = " ".join(out.split())  # argparse wraps the lines
    assert ("10% of the host memory" in words) == (command in WITH_ENGINE_ARGS)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("jaxserve ")
