"""The ``replay``, ``gate`` and ``mirror-gate`` commands: read JSON, run, write JSON, print a summary line.

Each command is ``add_*_arguments(parser)`` + ``run_*(args) -> exit code``, so the CLI can mount it as a
subcommand; ``main(argv)`` runs one on its own. Exit codes: 0 done (for the gates: promote), 2 bad input;
``gate`` and ``mirror-gate`` exit 3 on hold and 4 on rollback so a release script can branch on them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ominix_runtime.release.inputs import Fields, ReleaseInputError, load_json_object

EXIT_BAD_INPUT = 2
_DECISION_EXIT = {"promote": 0, "hold": 3, "rollback": 4}


def _write(path: str, payload: dict[str, object]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, sort_keys=False, allow_nan=False) + "\n")


def _guarded(name: str, body: Callable[[], int]) -> int:
    try:
        return body()
    except ReleaseInputError as exc:
        print(f"ominix-runtime {name}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


# ---- replay ---------------------------------------------------------------------------------------------


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="workload JSON (see docs/RELEASE.md)")
    p.add_argument("--output", required=True, help="report JSON to write")
    p.add_argument("--no-trace", action="store_true", help="leave the per-tick trace out of the report")


def run_replay(args: argparse.Namespace) -> int:
    from ominix_runtime.release.replay import ReplayStalled, replay
    from ominix_runtime.release.replay_report import replay_report
    from ominix_runtime.release.simulated_worker import WorkerContractViolation
    from ominix_runtime.release.workload import workload_from_json

    def body() -> int:
        workload = workload_from_json(load_json_object(args.input, "workload"))
        try:
            run = replay(workload)
        except (ReplayStalled, WorkerContractViolation) as exc:
            print(f"ominix-runtime replay: the scheduler failed the replay: {exc}", file=sys.stderr)
            return 1
        report = replay_report(run, include_trace=not args.no_trace)
        _write(args.output, report)
        kv = report["kv"]
        totals = report["totals"]
        assert isinstance(kv, dict) and isinstance(totals, dict)
        print(
            f"{report['trace_fingerprint']}  ticks {totals['ticks']}  finished {totals['finished']}/"
            f"{totals['requests']}  peak KV {kv['peak_blocks']} blocks ({kv['peak_pressure_pct']}%)  "
            f"blocks returned: {'yes' if kv['all_blocks_returned'] else 'NO'}"
        )
        return 0 if kv["all_blocks_returned"] else 1

    return _guarded("replay", body)


# ---- gate -----------------------------------------------------------------------------------------------


def add_gate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", help="gate JSON: {policy, baseline, candidate}")
    p.add_argument("--baseline", help="baseline observations JSON (instead of --input)")
    p.add_argument("--candidate", help="candidate observations JSON (instead of --input)")
    p.add_argument("--policy", help="policy JSON, with --baseline/--candidate (default: the built-in policy)")
    p.add_argument("--output", required=True, help="decision JSON to write")


def _print_decision(decision: dict[str, object]) -> int:
    print(f"decision: {decision['decision']}")
    reasons = decision["reasons"]
    assert isinstance(reasons, list)  # the gate's decision JSON lists its reasons
    for reason in reasons:
        print(f"  {reason}")
    return _DECISION_EXIT[str(decision["decision"])]


def run_gate(args: argparse.Namespace) -> int:
    from ominix_runtime.release.gate import evaluate, gate_from_json
    from ominix_runtime.release.gate_policy import policy_from_json
    from ominix_runtime.release.observations import build_from_json

    def body() -> int:
        if args.input:
            if args.baseline or args.candidate or args.policy:
                raise ReleaseInputError("give --input, or --baseline and --candidate, not both")
            decision = gate_from_json(load_json_object(args.input, "gate input"))
        else:
            if not (args.baseline and args.candidate):
                raise ReleaseInputError("give --input, or both --baseline and --candidate")
            policy = load_json_object(args.policy, "policy") if args.policy else {}
            decision = evaluate(
                build_from_json(Fields(load_json_object(args.baseline, "baseline"), "baseline")),
                build_from_json(Fields(load_json_object(args.candidate, "candidate"), "candidate")),
                policy_from_json(Fields(policy, "policy")),
            )
        _write(args.output, decision)
        return _print_decision(decision)

    return _guarded("gate", body)


# ---- mirror-gate ----------------------------------------------------------------------------------------


def add_mirror_gate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input", required=True, help="mirror JSON: {policy, baseline, candidate} in vLLM/SGLang form"
    )
    p.add_argument("--output", required=True, help="decision JSON to write")
    p.add_argument("--gate-input", default=None, help="also write the converted gate input here")


def run_mirror_gate(args: argparse.Namespace) -> int:
    from ominix_runtime.release.mirror import mirror_gate

    def body() -> int:
        gate_input, decision = mirror_gate(load_json_object(args.input, "mirror input"))
        if args.gate_input:
            _write(args.gate_input, gate_input)
        _write(args.output, decision)
        return _print_decision(decision)

    return _guarded("mirror-gate", body)


COMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {
    "replay": (
        "replay a workload through the real scheduler with a simulated backend",
        add_replay_arguments,
        run_replay,
    ),
    "gate": (
        "promote, hold or roll back a candidate from baseline/candidate observations",
        add_gate_arguments,
        run_gate,
    ),
    "mirror-gate": (
        "convert vLLM/SGLang-style mirrored observations to gate input and decide",
        add_mirror_gate_arguments,
        run_mirror_gate,
    ),
}


def main(command: str, argv: Sequence[str] | None = None) -> int:
    """Run one release command with its own arguments (``argv`` excludes the command name)."""
    help_text, add_arguments, run = COMMANDS[command]
    parser = argparse.ArgumentParser(prog=f"ominix-runtime {command}", description=help_text)
    add_arguments(parser)
    return run(parser.parse_args(argv))
