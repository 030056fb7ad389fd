"""The shipped systemd unit and the one install_service writes both pass `systemd-analyze verify` cleanly.

`systemd-analyze verify` exits 0 even on unknown keys (it only warns on stderr), so every check requires an
empty stderr too (notes/jetson.md §7.3). It fails when ExecStart's binary is missing, so the shipped unit is
verified with its executable path swapped for this venv's; unknown User=/Group= names are silently accepted.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from vismmoe_edge.cli.serve import install_service_command
from vismmoe_edge.serve import systemd as service

REPO = Path(__file__).resolve().parents[1]
SHIPPED_UNIT = REPO / "systemd" / "vismmoe-edge.service"
SHIPPED_ENV = REPO / "systemd" / "vismmoe-edge.env"
REGENERATE = (
    'regenerate: python -c "from pathlib import Path; from vismmoe_edge.serve.systemd import render_unit, render_env; '
    "Path('systemd/vismmoe-edge.service').write_text(render_unit()); "
    "Path('systemd/vismmoe-edge.env').write_text(render_env())\""
)

needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (Debian package 'systemd'; .ci/run installs it)",
)


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )


def assert_clean(unit: Path) -> None:
    result = verify(unit)
    assert result.returncode == 0 and result.stderr.strip() == "", f"rc={result.returncode}\n{result.stderr}"


def exec_start(unit_text: str) -> str:
    """ExecStart's value with its continuation lines joined."""
    return " ".join(re.search(r"^ExecStart=(.*)$", unit_text.replace("\\\n", " "), re.MULTILINE)[1].split())


def test_shipped_files_match_the_template() -> None:
    assert SHIPPED_UNIT.read_text() == service.render_unit(), REGENERATE
    assert SHIPPED_ENV.read_text() == service.render_env(), REGENERATE


def test_unit_has_the_conventions() -> None:
    text = service.render_unit()
    for line in (
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=30s",
        "Restart=on-failure",
        "RestartPreventExitStatus=2",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "LimitMEMLOCK=infinity",
        "SupplementaryGroups=video jtop",
        "User=vismmoe",
        "ProtectSystem=strict",
        "RuntimeDirectory=vismmoe-edge",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
    ):
        assert re.search(rf"^{re.escape(line)}$", text, re.MULTILINE), line
    # These break CUDA (W+X JIT memory) or hide the GPU device nodes: only ever mentioned in comments.
    for key in ("MemoryDenyWriteExecute", "PrivateDevices", "DeviceAllow", "ProtectClock", "ProcSubset"):
        assert not re.search(rf"^{key}=", text, re.MULTILINE), key
    # StartLimit* are ignored (with a warning) in [Service]: they must sit in [Unit].
    unit_section = text.split("\n[Service]\n")[0]
    assert "StartLimitBurst=" in unit_section and "StartLimitIntervalSec=" in unit_section


def test_every_exec_start_variable_is_in_the_env_file() -> None:
    env = service.render_env()
    defined = set(re.findall(r"^([A-Z_]+)=", env, re.MULTILINE))
    used = set(re.findall(r"\$\{?([A-Z_]+)\}?", exec_start(service.render_unit())))
    assert used and used <= defined, used - defined


def test_compile_caches_survive_a_restart() -> None:
    """PrivateTmp= empties /tmp at every start, where torch.compile keeps its cache by default: the env file puts
    torch.compile's and Triton's caches under the unit's CacheDirectory=, the one writable place kept across starts."""
    unit, env = service.render_unit(), service.render_env()
    assert re.search(r"^PrivateTmp=yes$", unit, re.MULTILINE)
    cache_root = "/var/cache/" + re.search(r"^CacheDirectory=(\S+)$", unit, re.MULTILINE)[1]
    settings = dict(re.findall(r"^([A-Z_]+)=(.*)$", env, re.MULTILINE))
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert Path(settings[variable]).is_relative_to(cache_root), (variable, settings[variable])


@needs_systemd
def test_shipped_unit_verifies(tmp_path: Path) -> None:
    real = service.find_executable()[0]  # ExecStart must name an existing executable
    text = SHIPPED_UNIT.read_text().replace(str(service.DEFAULT_EXECUTABLE), real)
    assert real in exec_start(text)
    unit = tmp_path / service.UNIT_NAME
    unit.write_text(text)
    assert_clean(unit)


@needs_systemd
def test_installed_unit_verifies(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    dest = tmp_path / "etc"
    result = service.install_service(model=model, dest=dest, user="vismmoe", settings={"VISMMOE_EDGE_TIER": "unified"})
    unit_text = result.unit_path.read_text()
    env_text = result.env_path.read_text()
    assert f"EnvironmentFile={dest.absolute() / 'vismmoe-edge.env'}" in unit_text
    assert Path(exec_start(unit_text).split()[0]).is_file()
    assert f"VISMMOE_EDGE_MODEL={model}" in env_text
    assert "VISMMOE_EDGE_TIER=unified" in env_text
    assert any("chown -R vismmoe:vismmoe" in step for step in result.next_steps)
    assert "sudo systemctl enable --now vismmoe-edge" in result.next_steps
    assert_clean(result.unit_path)


@needs_systemd
def test_demo_unit_verifies_without_model(tmp_path: Path) -> None:
    result = service.install_service(model=None, dest=tmp_path)
    assert "--model" not in exec_start(result.unit_text)
    assert "built-in demo model, trained on Shapes-VQA" in result.env_text
    assert_clean(result.unit_path)


@needs_systemd
def test_verify_reports_unknown_keys_on_stderr_only(tmp_path: Path) -> None:
    """Why assert_clean checks stderr: the exit status alone misses a misspelt directive."""
    result = service.install_service(model=None, dest=tmp_path)
    text = result.unit_text.replace("NoNewPrivileges=yes", "NoNewPrivileges=yes\nNoNewPrivilege=yes")
    result.unit_path.write_text(text)
    checked = verify(result.unit_path)
    assert checked.returncode == 0 and "Unknown key" in checked.stderr


def test_existing_env_file_is_kept_unless_forced(tmp_path: Path) -> None:
    first = service.install_service(model=tmp_path / "a", dest=tmp_path)
    assert first.env_written
    first.env_path.write_text("VISMMOE_EDGE_MODEL=/edited\n")
    second = service.install_service(model=tmp_path / "b", dest=tmp_path)
    assert not second.env_written and first.env_path.read_text() == "VISMMOE_EDGE_MODEL=/edited\n"
    third = service.install_service(model=tmp_path / "b", dest=tmp_path, force=True)
    assert third.env_written and f"VISMMOE_EDGE_MODEL={tmp_path / 'b'}" in third.env_path.read_text()


def test_cli_dry_run_prints_and_writes_nothing(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command("install-service")(install_service_command)
    app.command("noop")(lambda: None)  # two commands, so the subcommand name is parsed as in the real CLI
    result = CliRunner().invoke(
        app, ["install-service", "--dry-run", "--dest", str(tmp_path / "etc"), "--memory-budget", "6GiB"]
    )
    assert result.exit_code == 0, result.output
    assert "Type=notify" in result.output and "VISMMOE_EDGE_MEMORY_BUDGET=6GiB" in result.output
    assert "systemctl daemon-reload" in result.output
    assert not (tmp_path / "etc").exists()


def test_pinned_layers_go_to_extra_args_only_when_given(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command("install-service")(install_service_command)
    app.command("noop")(lambda: None)
    plain = CliRunner().invoke(app, ["install-service", "--dry-run"])
    pinned = CliRunner().invoke(app, ["install-service", "--dry-run", "--pinned-layers", "4"])
    assert "VISMMOE_EDGE_EXTRA_ARGS=\n" in plain.output  # serve takes the plan's pinned prefix
    assert "VISMMOE_EDGE_EXTRA_ARGS=--pinned-layers 4\n" in pinned.output


def test_exec_start_quotes_paths_with_spaces() -> None:
    config = service.ServiceConfig(exec_prefix=["/opt/my venv/bin/vismmoe-edge"])
    assert service.exec_start(config).startswith('"/opt/my venv/bin/vismmoe-edge" serve \\\n    --model ')


def test_exec_start_parses_with_the_serve_command() -> None:
    """The unit's argv, with the env file's values substituted, is accepted by `serve`'s own parser."""
    from vismmoe_edge.cli.serve import serve_command
    env = dict(re.findall(r"^([A-Z_]+)=(.*)$", service.render_env(), re.MULTILINE))
    words = exec_start(service.render_unit()).split()[1:]  # drop the executable
    assert words[0] == "serve"
    args: list[str] = []
    for word in words[1:]:
        if braced := re.fullmatch(r"\$\{(\w+)\}", word):
            args.append(env[braced[1]])  # ${VAR}: exactly one argument
        elif bare := re.fullmatch(r"\$(\w+)", word):
            args += env[bare[1]].split()  # $VAR: split on whitespace, none when empty
        else:
            args.append(word)
    app = typer.Typer()
    app.command()(serve_command)
    context = typer.main.get_command(app).make_context("serve", args)  # parses and validates; runs nothing
    assert context.params["listen"] == service.DEFAULT_LISTEN
    assert str(context.params["model"]) == str(service.DEFAULT_MODEL)
