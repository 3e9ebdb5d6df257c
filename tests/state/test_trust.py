"""`wandistiller.state.trust`: what the user allows a received run folder is what their command line gives, and wandb
stays offline unless asked."""

from __future__ import annotations

import argparse

from wandistiller.state.trust import Trust, add_trust_args


def test_trust_is_what_the_command_line_gives_and_wandb_stays_offline_unless_asked():
    parser = argparse.ArgumentParser()
    add_trust_args(parser, wandb=True)
    given = ["--allow-target", "a.B", "--allow-target", "c.D", "--teacher-path", "/t", "--allow-download"]
    trust = Trust.from_args(parser.parse_args(given))
    assert trust == Trust(("a.B", "c.D"), "/t", True, "offline")
    assert trust.open_args() == ("/t", ("a.B", "c.D"), True, None, None, None)  # no spec: inspected as received
    moved = Trust.from_args(parser.parse_args(["--teacher-path", "/t", "--teacher-lora", "/l/a.st", "/l/b.st"]))
    assert moved.open_args() == ("/t", (), False, None, None, ("/l/a.st", "/l/b.st"))  # open_run's teacher_loras
    assert Trust.from_args(parser.parse_args(["--wandb-mode", "online"])).wandb_mode == "online"
    without = argparse.ArgumentParser()
    add_trust_args(without)  # generate: no wandb flag, and its trust is offline
    assert Trust.from_args(without.parse_args([])) == Trust()
