"""Flags and settings are one system: every option of strata-run, strata-server and stratac that
carries a setting is made from its registry declaration (settings.option), never by hand; the few
options that are no setting are named in HAND_DECLARED with the reason. The value is the flag, else
STRATA_<NAME>, else the declared default; docs/settings.md lists every flag; the Python API's
keyword defaults are those of strata-server's flags."""

from __future__ import annotations

import inspect
from pathlib import Path

import click
import pytest

from strata_compiler import settings
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.errors import UsageError
from strata_compiler.formats import FORMATS
from strata_compiler.runtime import request_schema
from strata_compiler.runtime.api import Model
from strata_compiler.runtime.cli import strata_run
from strata_compiler.runtime.server_cli import strata_server

FLAGS = {s.flag for s in settings.SETTINGS if s.flag}
ROOT = Path(__file__).resolve().parents[1]

# The options made by click.option, each for its reason; every other option of these commands
# carries a setting and comes from the registry. Not settings: what one invocation reads or writes
# (its input files and text, its output files: a STRATA_PROMPT or STRATA_OUTPUT in the environment
# would silently feed every run), a switch between what the command does (a mode), an action.
HAND_DECLARED = {
    ("stratac", "--version"): "an action",
    ("stratac compile", "--output"): "the folder this compile writes",
    ("stratac compile", "--calib"): "an input file (calibration text, or a plan to reuse)",
    ("stratac compile", "--dump-dir"): "the folder the IR dumps are written to",
    ("stratac compile", "--chat-template"): "an input file, stored in the plan",
    ("stratac compile", "--eval-text"): "an input file (the KL check after the compile)",
    ("stratac inspect", "--json"): "a mode: one JSON object instead of tables",
    ("stratac eval", "--reference"): "an input model or plan",
    ("stratac eval", "--text"): "an input file",
    ("stratac eval", "--json"): "a mode: one JSON object instead of a table",
    ("stratac eval", "--per-layer"): "a mode: the per-layer report instead of the KL",
    ("stratac probe-hw", "--output"): "the file this probe writes",
    ("stratac probe-hw", "--show"): "a mode, reading this input file instead of measuring",
    ("strata-run", "--prompt"): "the input text",
    ("strata-run", "--input-ids"): "an input file",
    ("strata-run", "--greedy"): "a shorthand of --temperature 0 (which is a setting)",
    ("strata-run", "--stop"): "text of the request, as --prompt; repeatable (no registry kind holds a list of "
                              "arbitrary strings: any separator may be part of one)",
    ("strata-run", "--logits-out"): "an output file",
    ("strata-run", "--tokens-out"): "an output file",
    ("strata-run", "--trace"): "an output file",
    ("strata-run", "--chat"): "a mode: an interactive chat instead of one generation",
    ("strata-run", "--system"): "input text of --chat",
    ("strata-run", "--version"): "an action",
    ("strata-server", "--config"): "the file of settings itself (click's default map)",
    ("strata-server", "--version"): "an action",
}


def _commands() -> dict[str, click.Command]:
    out = {"stratac": stratac, "strata-run": strata_run, "strata-server": strata_server}
    out.update({f"stratac {n}": c for n, c in stratac.commands.items()})
    return out


def _flag(p: click.Option) -> str:
    return next(o for o in p.opts if o.startswith("--"))


def hand_declared(cmd: click.Command) -> list[str]:
    """The options of `cmd` that spell a registry setting's flag but were not made by settings.option."""
    return [p.opts[0] for p in cmd.params if isinstance(p, click.Option)
            and FLAGS & {*p.opts, *p.secondary_opts} and not settings.is_setting_option(p)]


def test_options_with_a_declared_flag_come_from_the_registry():
    bad = {name: found for name, cmd in _commands().items() if (found := hand_declared(cmd))}
    assert not bad, f"declare these through strata_compiler.settings.option, not click.option: {bad}"


def test_the_check_catches_a_hand_declared_option():
    @click.command()
    @click.option("--max-batch", type=int, default=8)
    def cmd(max_batch):
        pass

    assert hand_declared(cmd) == ["--max-batch"]


def test_every_option_is_a_setting_or_named_here():
    found = {(name, _flag(p)) for name, cmd in _commands().items() for p in cmd.params
             if isinstance(p, click.Option) and not settings.is_setting_option(p)}
    assert not found - set(HAND_DECLARED), (
        f"options declared by hand: declare them in strata_compiler/settings.py and make them with "
        f"settings.option, or, if they carry no setting, add them to HAND_DECLARED with the reason: "
        f"{sorted(found - set(HAND_DECLARED))}")
    assert not set(HAND_DECLARED) - found, f"HAND_DECLARED names options no command has: {set(HAND_DECLARED) - found}"


def test_the_docs_list_every_flag():
    rows = (ROOT / "docs" / "settings.md").read_text().splitlines()
    for name, cmd in _commands().items():
        for p in cmd.params:
            if settings.is_setting_option(p):
                s = p.setting
                assert any(r.startswith(f"| `{s.env}` | `{s.flag}` |") for r in rows), (name, s.flag)


def test_quant_choices_are_the_formats():
    assert settings.QUANT_CHOICES == ("auto", *FORMATS)


def test_every_flag_is_some_commands_option():
    used = {o for cmd in _commands().values() for p in cmd.params if settings.is_setting_option(p) for o in p.opts}
    assert FLAGS <= used, f"flags declared but no command has them: {sorted(FLAGS - used)}"


def test_shared_options_are_in_every_command_that_has_them():
    have = {name: {p.name for p in cmd.params if settings.is_setting_option(p)} for name, cmd in _commands().items()}
    assert {"backend", "device", "prefill_chunk", "debug"} <= have["strata-run"]
    assert {"backend", "device", "ctx", "max_batch", "prefill_chunk", "queue_size", "debug"} <= have["strata-server"]
    assert {"backend", "ctx", "debug"} <= have["stratac eval"] and {"backend", "debug"} <= have["stratac compile"]


def test_the_apis_keywords_are_strata_servers_flags():
    """Model(...)'s options default to None: the flag's declared default (or its variable)."""
    server = {p.name: p for p in strata_server.params}
    params = list(inspect.signature(Model.__init__).parameters.values())[2:]
    assert [p.name for p in params] == ["backend", "device", "ctx", "max_batch", "prefill_chunk", "queue_size"]
    for p in params:
        assert p.default is None and settings.declared(p.name).flag, p.name
        assert settings.is_setting_option(server[p.name]) and server[p.name].setting.name == p.name


def test_declared_ranges_are_the_schemas():
    assert settings.declared("max_batch").maximum == request_schema.MAX_BATCH
    assert settings.declared("prefill_chunk").maximum == request_schema.MAX_CHUNK


def _params(cmd: click.Command, *args: str) -> dict:
    return cmd.make_context(cmd.name, list(args)).params


def test_flag_beats_environment_beats_default(monkeypatch, tmp_path):
    monkeypatch.delenv("STRATA_MAX_BATCH", raising=False)
    monkeypatch.delenv("STRATA_BACKEND", raising=False)
    assert _params(strata_server, "plan")["max_batch"] == 8
    assert _params(strata_server, "plan")["backend"] == "auto"
    monkeypatch.setenv("STRATA_MAX_BATCH", "3")
    monkeypatch.setenv("STRATA_BACKEND", "LLVM")
    got = _params(strata_server, "plan")
    assert (got["max_batch"], got["backend"]) == (3, "llvm")
    assert _params(strata_run, "plan")["backend"] == "llvm"
    got = _params(strata_server, "plan", "--max-batch", "5", "--backend", "reference")
    assert (got["max_batch"], got["backend"]) == (5, "reference")
    conf = tmp_path / "s.toml"
    conf.write_text("max_batch = 6\n")      # a --config file is the command line's too
    assert _params(strata_server, "plan", "--config", str(conf))["max_batch"] == 6


def test_a_command_may_change_a_declared_default(monkeypatch):
    """strata-run's --prefill-chunk: auto (None) and no upper bound, yet STRATA_PREFILL_CHUNK sets it."""
    monkeypatch.delenv("STRATA_PREFILL_CHUNK", raising=False)
    assert _params(strata_run, "plan")["prefill_chunk"] is None
    assert _params(strata_server, "plan")["prefill_chunk"] == 256
    monkeypatch.setenv("STRATA_PREFILL_CHUNK", "10000")
    assert _params(strata_run, "plan")["prefill_chunk"] == 10000


def test_end_to_end_a_bad_variable_is_one_line_unless_the_flag_is_given(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("STRATA_MAX_BATCH", "0")
    missing = str(tmp_path / "no-plan")
    assert run_cli(strata_server, [missing]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: STRATA_MAX_BATCH='0': give a whole number from 1 to 256") and err.count("\n") == 1
    assert run_cli(strata_server, [missing, "--max-batch", "2"]) != 0      # the flag wins: the variable unread
    err = capsys.readouterr().err
    assert "STRATA_MAX_BATCH" not in err and "no-plan" in err
    assert run_cli(strata_server, [missing, "--max-batch", "0"]) == 2      # the flag's own check, as before
    assert "Invalid value for '--max-batch'" in capsys.readouterr().err


def test_help_names_the_variable():
    with click.Context(strata_server) as ctx:
        text = strata_server.get_help(ctx)
    assert "STRATA_MAX_BATCH" in text and "default: 8" in text


def test_the_api_reads_the_registry(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_QUEUE_SIZE", "x")
    with pytest.raises(UsageError, match="STRATA_QUEUE_SIZE"):
        Model(tmp_path / "no-plan")


def test_the_api_takes_its_defaults_from_the_registry(tiny_int8_plan):
    with settings.override(max_batch=2, prefill_chunk=16, queue_size=5):
        with Model(tiny_int8_plan, backend="llvm", max_batch=3) as m:
            assert (m.engine.max_batch, m.engine.chunk, m.engine.queue.maxsize) == (3, 16, 5)


def test_every_command_reads_its_options_variables(monkeypatch):
    """A flag moved into the registry keeps its default, and its variable sets it."""
    compile_ = stratac.commands["compile"]
    base = _params(compile_, "model", "-o", "out")
    assert (base["quant"], base["group_size"], base["imatrix"], base["expert_cache"], base["bits"]) == \
        ("auto", 32, True, False, None)
    got = _params(strata_run, "plan")
    assert (got["max_new_tokens"], got["temperature"], got["seed"], got["expert_cache"], got["miss_path"]) == \
        (32, None, 0, True, "auto")
    got = _params(strata_server, "plan")
    assert (got["host"], got["port"], got["prompt_cache"], got["api_key"], got["log_level"]) == \
        ("127.0.0.1", 8080, 1024, None, "info")
    for var, val in (("STRATA_QUANT", "INT8"), ("STRATA_IMATRIX", "0"), ("STRATA_COMPILE_EXPERT_CACHE", "1"),
                     ("STRATA_TEMPERATURE", "0.5"), ("STRATA_MAX_NEW_TOKENS", "7"), ("STRATA_EXPERT_CACHE", "off"),
                     ("STRATA_PORT", "9000"), ("STRATA_API_KEY", "k")):
        monkeypatch.setenv(var, val)
    got = _params(compile_, "model", "-o", "out")
    assert (got["quant"], got["imatrix"], got["expert_cache"]) == ("int8", False, True)
    got = _params(strata_run, "plan")
    assert (got["temperature"], got["max_new_tokens"], got["expert_cache"]) == (0.5, 7, False)
    assert _params(strata_run, "plan", "-n", "3", "--expert-cache")["max_new_tokens"] == 3
    got = _params(strata_server, "plan")
    assert (got["port"], got["api_key"]) == (9000, "k")


def test_an_open_lower_bound(monkeypatch):
    s = settings.declared("top_p")
    assert s.parse("1") == 1.0 and s.parse("0.01") == 0.01
    with pytest.raises(UsageError, match=r"STRATA_TOP_P='0': give a number > 0 and <= 1 \(default the model's\)"):
        s.parse("0")
    with pytest.raises(UsageError, match="give a number > 0"):
        settings.declared("repeat_penalty").parse("0")
    monkeypatch.setenv("STRATA_TOP_P", "0")
    assert run_cli(strata_run, ["no-plan"]) == 2
    with pytest.raises(click.BadParameter):
        _params(strata_run, "plan", "--top-p", "0")


def test_a_short_flag_comes_first_and_errors_name_the_flag(capsys):
    n = next(p for p in strata_run.params if p.name == "max_new_tokens")
    assert n.opts == ["-n", "--max-new-tokens"] and settings.is_setting_option(n)
    assert run_cli(strata_run, ["plan", "-n", "-1"]) == 2
    err = capsys.readouterr().err
    assert "Invalid value for '-n' / '--max-new-tokens': -1" in err and "STRATA_" not in err


def test_greedy_beats_the_temperature_variable(monkeypatch, capsys, tmp_path):
    """--greedy is --temperature 0 given on the command line: it wins over STRATA_TEMPERATURE, and
    contradicts only a --temperature flag."""
    monkeypatch.setenv("STRATA_TEMPERATURE", "0.7")
    missing = str(tmp_path / "no-plan")
    assert run_cli(strata_run, [missing, "--prompt", "x", "--greedy"]) != 2      # on to the missing plan
    assert "no-plan" in capsys.readouterr().err
    assert run_cli(strata_run, [missing, "--prompt", "x", "--greedy", "--temperature", "0.5"]) == 2
    assert "contradict" in capsys.readouterr().err


def test_a_declared_none_default_shows_what_it_means():
    assert settings.declared("api_key").shown_default() == "none"
    assert settings.declared("ctx").shown_default() == "auto"
    assert settings.declared("temperature").shown_default() == "the model's"
