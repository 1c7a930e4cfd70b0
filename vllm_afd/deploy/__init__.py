"""The deployment library: what ``vllm-afd launch``, ``bench``, ``plan`` and
``demo`` start, and how.

::

    DeploymentSpec (spec.py)          topology, ports, devices, hosts, supervision
      -> role_processes (commands.py) one RoleProcess per vllm serve, FFN ranks first
      -> Deployment (deployment.py)   start, wait healthy, supervise, stop in order
    PlainServer (plain.py)            the plain-vLLM baseline on the same settings
    Placement (placement.py)          which node runs which rank, across hosts
    RoleProcess (process.py)          one process group, its log, its stop

Commands in ``vllm_afd.cli`` parse arguments and call this package; tests and
tools import it too.
"""

from __future__ import annotations

from vllm_afd.deploy.commands import dry_run, role_processes
from vllm_afd.deploy.deployment import Deployment, ready_line
from vllm_afd.deploy.plain import PlainServer
from vllm_afd.deploy.process import DeploymentEnded, LaunchError, RoleProcess
from vllm_afd.deploy.spec import DeploymentSpec

__all__ = [
    "Deployment",
    "DeploymentEnded",
    "DeploymentSpec",
    "LaunchError",
    "PlainServer",
    "RoleProcess",
    "dry_run",
    "ready_line",
    "role_processes",
]
