"""enginesim: a vLLM V1 (0.11) engine simulator for tests and benchmarks.

The scheduler core (``enginesim.scheduler``) is pure; ``enginesim.engine`` runs it on an
asyncio clock, ``enginesim.server`` serves vLLM's OpenAI-compatible API, /metrics and a
/control API, and ``enginesim.cli`` is the command line (``python -m enginesim``).
"""

from .config import PRESETS, SimConfig
from .engine import Engine, EngineClock
from .metrics import EngineMetrics
from .scheduler import (
    CostModel,
    RequestRejected,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
)
from .server import create_app, create_runner

__all__ = [
    "PRESETS",
    "CostModel",
    "Engine",
    "EngineClock",
    "EngineMetrics",
    "RequestRejected",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SimConfig",
    "create_app",
    "create_runner",
]
