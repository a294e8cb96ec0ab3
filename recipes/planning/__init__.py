"""The planner: a recipe's memory, time, cost and benchmark price on given hardware (`python -m recipes.plan`).

`plan` makes the plan from `memory`, `step_time` (the communication and host model), `eval_cost` and `hardware`;
`report` says it; `search` ranks the configurations that fit; `cli` is the command line.
"""

from recipes.planning.cli import main
from recipes.planning.hardware import Hardware, hardware_from, live_hardware
from recipes.planning.plan import DEFAULT_DEEPSPEED_JSON, Plan, make_plan, plan_predictions, predicted_step
from recipes.planning.report import format_plan, json_summary

__all__ = ["DEFAULT_DEEPSPEED_JSON", "Hardware", "Plan", "format_plan", "hardware_from", "json_summary",
           "live_hardware", "main", "make_plan", "plan_predictions", "predicted_step"]  # fmt: skip
