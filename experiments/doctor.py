"""`gptrun doctor`: whether this installation, and the cluster at `--address`, can run gptrun.

It prints the versions, checks every private name of torch, Ray and Optuna that gptrun uses
(the fences `gptcore.private_torch`, `experiments.private_ray`, `experiments.private_optuna`),
and probes what `train.precision = "auto"` and `train.compile` will meet on this machine; with
an address, every alive node of the cluster answers the versions and fence checks too. Each
problem is one line; the exit status is 1 when there is any, so a script or a cluster's start-up
can gate on it.
"""

from __future__ import annotations

import platform
import time
from typing import Any

from experiments.cluster import ask_each_node, check_address, node_names, resolve_address, versions
from experiments.private_optuna import FENCED as OPTUNA_NAMES
from experiments.private_ray import FENCED as RAY_NAMES
from gptcore.errors import first_line
from gptcore.fence import Private, missing
from gptcore.private_torch import FENCED as TORCH_NAMES


def fenced() -> list[Private]:
    """Every private name gptrun uses, over the three fences."""
    return [*TORCH_NAMES, *RAY_NAMES, *OPTUNA_NAMES]


def node_report(_: str = "") -> dict[str, Any]:
    """What a node answers: its versions and its fence problems (run in a task on each node)."""
    return {"versions": versions(), "problems": missing(fenced())}


def precision_probe() -> str:
    """What `train.precision = "auto"` picks on this machine's default device, and why."""
    from gptcore.device import resolve_device
    from gptcore.train import resolve_precision

    device = resolve_device("auto")
    precision, reason = resolve_precision("auto", device)
    return f"{device.type}: precision auto -> {precision} ({reason})"


def compile_probe() -> tuple[str, str | None]:
    """(a line on torch.compile here, a problem or None): a small function compiled and run
    once in gptrun's compile cache, as a training run would."""
    import torch

    from gptcore.autocompile import share_compile_cache

    share_compile_cache()
    start = time.perf_counter()
    try:
        compiled = torch.compile(lambda x: torch.nn.functional.gelu(x @ x.T).sum())
        compiled(torch.randn(16, 16))
    except Exception as err:  # what a run with train.compile = true would meet
        return (
            "torch.compile: fails",
            f"torch.compile fails here ({first_line(err)}); use train.compile = false",
        )
    return f"torch.compile: works ({time.perf_counter() - start:.1f} s for a first small compile)", None


def run_doctor(address: str | None) -> int:
    """Print the checks; 0 when nothing is wrong, 1 otherwise."""
    import optuna
    import torch

    address = resolve_address(address)
    check_address(address)  # a malformed one is refused before the probes, not after
    here = versions()
    cuda = f", CUDA {torch.version.cuda}: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    print(f"python {platform.python_version()}, gptrun {here['gptrun']}, torch {torch.__version__}{cuda}")
    print(f"ray {here['ray']}, optuna {optuna.__version__}")
    names = fenced()
    problems = missing(names)
    print(f"private names of torch, Ray and Optuna: {len(names) - len(problems)}/{len(names)} present")
    print(precision_probe())
    line, problem = compile_probe()
    print(line)
    problems += [problem] if problem else []
    if address is not None:
        problems += cluster_problems(address, here)
    for problem in problems:
        print(f"problem: {problem}")
    print("all checks passed" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


def cluster_problems(address: str, here: dict[str, str]) -> list[str]:
    """Join the cluster and ask every alive node for its versions and fence problems."""
    import ray

    from experiments.cluster import ray_session, resource_wait_s

    with ray_session(address):
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        answers, pending = ask_each_node(node_report, "", nodes, resource_wait_s())
    print(f"cluster {address}: {len(nodes)} node(s) alive, {len(answers)} answered")
    problems = []
    for node, report in answers:
        differ = [f"{name} {v}" for name, v in report["versions"].items() if v != here[name]]
        if differ:
            problems.append(f"node {node_names([node])} runs {', '.join(differ)}; this machine {here}")
        problems += [f"node {node_names([node])}: {p}" for p in report["problems"]]
    if pending:
        problems.append(f"{pending} node(s) did not answer within {resource_wait_s():g}s")
    return problems
