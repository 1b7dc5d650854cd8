"""In-process, virtual-clock simulation of whole RL jobs (paper §6): pure, no I/O.

``ClusterSimulation(SimulatedCluster(...)).run(steps) -> RunResult`` simulates one system on one
cluster; ``run_experiment(ExperimentSpec(...))`` compares systems across staleness bounds and
sweeps. See docs/benchmarks.md.
"""

from staleflow.simulation.cluster import ClusterSimulation, CountedRequest, SimulationStalled, simulate
from staleflow.simulation.experiment import (
    PAPER_TARGETS,
    ExperimentResult,
    ExperimentSpec,
    Point,
    PointResult,
    SimulatedJob,
    parse_sweep,
    run_experiment,
    run_job,
)
from staleflow.simulation.result import Breakdown, DecisionStats, RunResult, SimStepRecord, Timeline
from staleflow.simulation.scenarios import SCENARIOS, ReplayWorkload, Scenario, load_workload, scenario
from staleflow.simulation.settings import CommandCosts, SimulatedCluster, TrainerModel
from staleflow.simulation.systems import Family, Pipeline, SystemSpec, catalog, resolve

__all__ = [
    "PAPER_TARGETS", "SCENARIOS", "Breakdown", "SimulatedCluster", "ClusterSimulation", "CommandCosts", "CountedRequest",
    "DecisionStats", "ExperimentResult", "ExperimentSpec", "Family", "SimulatedJob", "Pipeline", "Point", "PointResult",
    "ReplayWorkload", "RunResult", "Scenario", "SimulationStalled", "SimStepRecord", "SystemSpec", "Timeline",
    "TrainerModel", "catalog", "load_workload", "parse_sweep", "resolve", "run_experiment", "run_job", "scenario",
    "simulate",
]
