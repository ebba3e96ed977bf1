"""The node agent: the one thing that starts and stops engines on a machine.

Every GPU machine runs one agent. It discovers the machine's GPUs, follows the
replicas desired for this node (a controller's long-poll, or a file), starts
each as an engine process in its own process group with its GPUs, port, args
and env, health-checks it, restarts it with backoff when it crashes, stops it
(SIGTERM, grace, SIGKILL) when it is no longer desired, and reports all of it.
It survives its own restart: engines outlive the agent, and the next agent
adopts them from its state file.

    gpus        the inventory: nvidia-smi, a simulated SPEC, or none
    ports       the --ports range and picking a free port
    backoff     the restart schedule
    procs       /proc, process groups, spawning, logs (all blocking)
    state       replicas.json, written atomically
    desired     desired-list documents and the --desired file follower
    core        Agent: reconcile_once(), adoption, start/stop, report()
    replica     Replica, the agent's record of one replica, and how it is saved and reported
    health      health probes of starting and ready engines; a ready one that stops answering
    members     a group's worker: no port, no probe, ready once it ran a while; the groups' ports held
    groups      stopping an engine's process group (SIGTERM, grace, SIGKILL)
    gpushare    which GPUs a replica gets, and free memory net of our shares
    controller  the agent protocol: report POSTs and the desired long-poll
    run         wiring one agent process

It must not know about the catalog, placement or the router: what to run
arrives as `ReplicaSpec`s, and engines are known only through their drivers.
"""
from .core import FAILED, READY, STARTING, STOPPING, Agent, Replica
from .errors import AgentError, DesiredError, GpuSpecError, PortRangeError, StateLockedError
from .gpus import discover, parse_nvidia_smi, parse_spec
from .ports import PortRange
from .run import AgentConfig, main, run_agent

__all__ = [
    "Agent", "AgentConfig", "AgentError", "DesiredError", "FAILED", "GpuSpecError", "PortRange",
    "PortRangeError", "READY", "Replica", "STARTING", "STOPPING", "discover", "main", "parse_nvidia_smi",
    "parse_spec", "run_agent", "StateLockedError",
]
