"""The fleet simulator: a discrete-event model of a splitserve cluster (see sim/simulator.py),
and the hardware profiles it runs on. It runs the router's own policy objects: routing
(`policies.routing`) over the real in-process prefix index (`prefix_index.memory`), fed by the
simulated workers' real `BlockPool` events, and prefix pulls (`policies.prefix_pull`) (sim/router.py);
admission (`policies.admission` through its `AdmissionGate`), fed the simulated workers' step reports
(sim/admission.py)."""

from sim.config import Fault, SimConfig
from sim.profile import ModelFacts, Overheads, Profile, Transfer
from sim.result import SimRecord, SimResult, SimSummary
from sim.seq import SimRequest
from sim.simulator import Simulation, simulate
from sim.step_cost import StepCost
from sim.worker import EngineLimits

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
