"""Re-capture ``plan_request_baseline.json``'s plans and lines with today's planner (run from the repository root).

Each case keeps its cluster, model, settings and planner section; its ``plan`` and ``line`` become what
``planning.plan`` returns now, and each ``data_parallel`` case's plan what ``data_parallel_plan`` returns.  Run it
only for a change that is meant to change plans (the memory model's, the cost model's), and say so in the test's
docstring and the CHANGELOG.
"""

from __future__ import annotations

import json
from pathlib import Path

from het_strategy.core.cluster import load_cluster
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import load_workload
from het_strategy.planning import PlanRequest, plan
from het_strategy.planning.strategy_plans import data_parallel_plan
from het_strategy.reference.sailor_profiles import request_profile

PATH = Path(__file__).with_name("plan_request_baseline.json")


def main() -> None:
    data = json.loads(PATH.read_text())
    for case in data["cases"]:
        settings = TrainSettings(**{"max_tp": 1, **case["settings"]})
        cluster, workload = load_cluster(case["cluster"]), load_workload(case["model"], dtype=settings.dtype)
        request = PlanRequest(**case["planner"])
        result = plan(cluster, workload, settings, request, request_profile(request, workload))
        case["plan"], case["line"] = result.plan.to_dict(), result.summary()
    for case in data["data_parallel"]:
        cluster, workload = load_cluster(case["cluster"]), load_workload(case["model"], dtype=case["dtype"])
        got = data_parallel_plan(cluster, workload, case["global_batch_size"], case["dtype"]).to_dict()
        for price in ("dollars_per_hour", "dollars_per_iteration", "num_used"):
            got["predicted"].pop(price, None)
        case["plan"] = got
    PATH.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
