"""The fleet simulator: a discrete-event model of a splitserve cluster (see cluster/sim/simulator.py),
and the hardware profiles it runs on."""

from cluster.sim.config import Fault, SimConfig
from cluster.sim.profile import ModelFacts, Overheads, Profile, Transfer
from cluster.sim.result import SimRecord, SimResult, SimSummary
from cluster.sim.seq import SimRequest
from cluster.sim.simulator import Simulation, simulate
from cluster.sim.step_cost import StepCost
from cluster.sim.worker import EngineLimits

__all__ = [
    "EngineLimits",
    "Fault",
    "ModelFacts",
    "Overheads",
    "Profile",
    "SimConfig",
    "SimRecord",
    "SimRequest",
    "SimResult",
    "SimSummary",
    "Simulation",
    "StepCost",
    "Transfer",
    "simulate",
]
