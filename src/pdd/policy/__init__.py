"""Pure serving policy shared by the router and the simulator.

No torch, no asyncio, no sockets, no clock: snapshots in (frozen
dataclasses, `now` in seconds), decisions out.
"""

from pdd.policy.config import HandoffOverride, PolicyConfig
from pdd.policy.filter import (
    PrefixReuseCounter, RelayBudgets, ShareBudget, in_filter_class, predict_abnormal, should_cancel_wan,
    warm_after_skip, warm_tokens_after_cancel,
)
from pdd.policy.handoff import (
    Abandon, Complete, HandoffAction, HandoffError, HandoffMode, HandoffSession, HandoffState,
    SendBatch, choose_handoff_mode, new_session,
)
from pdd.policy.lifecycle import RequestLifecycle, pick_spare
from pdd.policy.lifecycle_io import Outcome
from pdd.policy.link_estimator import EstimatorConfig, LinkEstimator
from pdd.policy.pipeline import (
    NoRouteError, Pipeline, PipelineDecision, cancel_wan, choose_pipeline, BudgetEntries,
    copy_yields_line, keep_wan_copy, note_decision, plan_warm,
)
from pdd.policy.rld_loss import RldLossAction, RldLossFacts, on_rld_lost, stalled
from pdd.policy.routing import pick_instance, score_instance, wait_for_siblings
from pdd.policy.views import ClusterView, InstanceView, LinkEstimate, RequestFacts, Role

__all__ = [
    "Abandon", "ClusterView", "Complete", "EstimatorConfig", "HandoffAction", "HandoffError",
    "HandoffMode", "HandoffOverride", "HandoffSession", "HandoffState", "InstanceView",
    "LinkEstimate", "LinkEstimator", "NoRouteError", "Outcome", "RequestLifecycle", "Pipeline", "PipelineDecision", "RldLossAction", "RldLossFacts",
    "PolicyConfig", "PrefixReuseCounter", "RelayBudgets", "RequestFacts", "Role", "SendBatch",
    "ShareBudget", "cancel_wan", "choose_handoff_mode", "choose_pipeline", "BudgetEntries",
    "copy_yields_line",
    "in_filter_class", "keep_wan_copy", "new_session", "note_decision", "on_rld_lost", "pick_instance", "pick_spare", "plan_warm",
    "predict_abnormal", "score_instance", "should_cancel_wan", "stalled", "wait_for_siblings", "warm_after_skip",
    "warm_tokens_after_cancel",
]
