"""Flags and settings are one system: an option of strata-run, strata-server or stratac whose flag
a registry setting declares is made from that declaration (settings.option), never by hand; the
value is the flag, else STRATA_<NAME>, else the declared default; the Python API's keyword defaults
are those of strata-server's flags."""

from __future__ import annotations

import inspect

import click
import pytest

from strata_compiler import settings
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.errors import UsageError
from strata_compiler.runtime import request_schema
from strata_compiler.runtime.api import Model
from strata_compiler.runtime.cli import strata_run
from strata_compiler.runtime.server_cli import strata_server

FLAGS = {s.flag for s in settings.SETTINGS if s.flag}


def _commands() -> dict[str, click.Command]:
    out = {"strata-run": strata_run, "strata-server": strata_server}
    out.update({f"stratac {n}": c for n, c in stratac.commands.items()})
    return out


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


def test_every_flag_is_some_commands_option():
    used = {p.opts[0] for cmd in _commands().values() for p in cmd.params if settings.is_setting_option(p)}
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
