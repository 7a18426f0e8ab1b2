"""``mm3-compile``: argument errors, --help, --version, platform --json, progress, the report, verdicts, exit codes."""

import io
import json
import re

import pytest

from mm3_compile import cli, platform
from mm3_compile.models import MiniMaxM3Config, random_full_state
from tests.models.release_checkpoint import write_checkpoint


def test_cli_refuses_bad_arguments_clearly(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--steps", "x"])
    assert "argument --steps: invalid integer value: 'x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["demo", "--emulate", ""])
    err = capsys.readouterr().err
    assert "argument --emulate: invalid choice: ''" in err and all(t in err for t in platform.EMULATION_TARGETS)
    with pytest.raises(SystemExit, match="--layers: only with --checkpoint"):
        cli.main(["demo", "--layers", "1"])
    with pytest.raises(SystemExit, match="--config: not with --checkpoint"):
        cli.main(["demo", "--config", "tiny", "--checkpoint", "/nonexistent"])
    with pytest.raises(SystemExit, match=r"--checkpoint /nonexistent: path: expected a checkpoint directory"):
        cli.main(["demo", "--checkpoint", "/nonexistent"])
    monkeypatch.setenv(platform.EMULATE_ENV, "bogus")
    with pytest.raises(SystemExit, match="MM3_EMULATE='bogus': unknown platform target"):
        cli.main(["platform"])


def test_help_shows_every_option_with_help_and_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    options = re.findall(r"^  (--[a-z-]+)", out, flags=re.MULTILINE)
    assert set(options) >= {"--device", "--kv-cache-dtype", "--steps", "--batch", "--emulate", "--config"}
    assert {"--checkpoint", "--layers", "--backend", "--tokens"} <= set(options)
    for option in options:
        if option == "--help":
            continue
        entry = re.search(rf"^  {option}\b.*?(?=^  --|\Z)", out, flags=re.MULTILINE | re.DOTALL).group(0)
        assert "(default:" in entry, entry  # ArgumentDefaultsHelpFormatter adds it to every option with help
    assert "{sm_90,sm_100,gfx942,gfx950,cpu}" in out
    with pytest.raises(SystemExit):
        cli.main(["platform", "--help"])
    assert "--json" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert re.fullmatch(r"mm3-compile \S+\n", capsys.readouterr().out)


def test_platform_json(capsys):
    assert cli.main(["platform", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == json.loads(json.dumps(platform.resolution_table()))
    assert {r["target"] for r in rows} >= set(platform.EMULATION_TARGETS)


class _Step:
    kind, seconds = "decode", 0.25


def test_progress_is_one_line_per_step_in_a_log_and_redrawn_on_a_terminal():
    log = io.StringIO()
    progress = cli.Progress("eager", 3, log)
    for _ in range(3):
        progress(_Step())
    assert log.getvalue().splitlines() == [f"eager    step {i}/3 decode    0.25 s" for i in (1, 2, 3)]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    progress = cli.Progress("eager", 2, tty)
    progress(_Step())
    progress(_Step())
    assert tty.getvalue().count("\r") == 2 and tty.getvalue().count("\n") == 1


def test_report_fits_100_columns():
    rows = [
        cli._row("a rather long check name that goes on and on", "word " * 60, True),
        cli._row("short", "x" * 150, False),
        cli._row("info", "no verdict"),
    ]
    text = cli._table(rows)
    assert max(len(line) for line in text.splitlines()) <= cli.REPORT_WIDTH
    assert "word " * 3 in text and text.count("x") == 150 and "PASS" in text and "FAIL" in text
    wide = [platform.platform_for("cpu").describe() | {"kv fp8_e5m2 and more": "float8_e5m2fnuz"}]
    assert max(len(line) for line in cli._table(wide).splitlines()) <= cli.REPORT_WIDTH


def test_a_failed_check_fails_the_demo(monkeypatch, capsys):
    def rows(args, device):
        return [cli._row("graph breaks (fullgraph=True)", "0", True), cli._row("vs reference", "0.3", False)]

    monkeypatch.setattr(cli, "model_demo", rows)
    monkeypatch.setattr(cli, "quant_demo", lambda device, tokens: [cli._row("quant", "ok", True)])
    assert cli.main(["demo", "--device", "cpu"]) == 1
    assert "FAIL: 1 of 3 checks failed: vs reference" in capsys.readouterr().out
    monkeypatch.setattr(cli, "model_demo", lambda args, device: [cli._row("graph breaks", "0", True)])
    assert cli.main(["demo", "--device", "cpu"]) == 0
    assert "PASS: all 2 checks passed" in capsys.readouterr().out


def test_layers_loads_the_first_layers_of_a_checkpoint(tmp_path):
    """``--layers N`` loads the first N decoder layers (the checkpoint's others are reported as skipped)."""
    config = MiniMaxM3Config.tiny()
    write_checkpoint(tmp_path, random_full_state(config, seed=5), config)
    args = cli._parse(["demo", "--device", "cpu", "--checkpoint", str(tmp_path), "--layers", "1"])
    demo = cli._demo_model(args, "cpu")
    assert demo.config.num_hidden_layers == 1 and len(demo.model.layers) == 1
    assert any("model.layers.1." in n for n in demo.model.checkpoint_report.skipped)


@pytest.mark.interpreter
def test_demo_runs_a_release_checkpoint_and_passes(tmp_path, capsys):
    """The main job end to end from a checkpoint directory (aot_eager; ~3 min on the CPU interpreter)."""
    config = MiniMaxM3Config.tiny()
    write_checkpoint(tmp_path, random_full_state(config, seed=5), config)
    argv = ["demo", "--device", "cpu", "--checkpoint", str(tmp_path), "--batch", "1", "--steps", "1"]
    assert cli.main([*argv, "--backend", "aot_eager", "--kv-cache-dtype", "fp8"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "PASS: all" in out and "FAIL" not in out
    flat = " ".join(out.split())  # the report wraps long values
    assert (
        "40 MXFP8 linears as stored, 0 quantized at load" in flat and "2 skipped (MTP/vision/truncated layers)" in flat
    )
    assert max(len(line) for line in out.splitlines()) <= cli.REPORT_WIDTH
    err = captured.err.splitlines()  # not a terminal: one line per step, status lines before the long parts
    assert any(line.startswith("eager    step 1/2 prefill") for line in err)
    assert any(line.startswith("... compiling prefill and decode graphs with aot_eager") for line in err)
    assert sum("step" in line and "/2" in line for line in err) == 6  # eager, compiled, replay
