"""A placement as the launchers take it (`threefold plan --topology FILE --launch-out DIR`):
hosts in node-rank order for torchrun's static rendezvous, an sbatch script whose `srun` runs
one torchrun agent per host in that order (`--distribution=arbitrary` over `SLURM_HOSTFILE`),
and a JobSet manifest with one single-pod job per host, pinned to it by
`kubernetes.io/hostname`, its node rank its position.

torchrun's c10d rendezvous numbers nodes in arrival order, so every output here uses the static
one (`--node-rank k --master-addr hosts[0]`): the order is the placement's.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from threefold.atomic import atomic_write

PORT = 29500


def torchrun_command(nnodes: int, nproc: int, node_rank: str, master: str, config: str) -> list[str]:
    return [
        "torchrun",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--node-rank={node_rank}",
        f"--master-addr={master}",
        f"--master-port={PORT}",
        "-m",
        "threefold",
        "train",
        "--config",
        config,
    ]


def sbatch_text(hosts: list[str], nproc: int, config: str, hostfile: str) -> str:
    """One srun task per host, task k on hosts[k] (SLURM_HOSTFILE, --distribution=arbitrary), each
    a torchrun agent with node rank SLURM_PROCID."""
    command = shlex.join(torchrun_command(len(hosts), nproc, "$SLURM_PROCID", hosts[0], config))
    command = command.replace("'--node-rank=$SLURM_PROCID'", '--node-rank="$SLURM_PROCID"')
    return "\n".join(
        [
            "#!/bin/bash",
            "#SBATCH --job-name=threefold",
            f"#SBATCH --nodes={len(hosts)}",
            f"#SBATCH --nodelist={','.join(hosts)}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --gpus-per-node={nproc}",
            "# Written by threefold plan --topology: task k runs on line k of the host file (the placement's",
            "# node rank k), and torchrun's static rendezvous keeps that order.",
            f"export SLURM_HOSTFILE={shlex.quote(hostfile)}",
            f"srun --ntasks={len(hosts)} --distribution=arbitrary bash -c {shlex.quote(command)}",
            "",
        ]
    )


def jobset(hosts: list[str], nproc: int, config: str, image: str, name: str = "threefold") -> dict:
    """A JobSet (jobset.x-k8s.io/v1alpha2): replicated job `node-k`, one pod on hosts[k], node
    rank k; node 0's pod is the master (`<name>-node-0-0-0.<name>`, the JobSet's headless service)."""
    master = f"{name}-node-0-0-0.{name}"
    jobs = []
    for k, host in enumerate(hosts):
        container = {
            "name": "trainer",
            "image": image,
            "command": torchrun_command(len(hosts), nproc, str(k), master, config),
            "resources": {"limits": {"nvidia.com/gpu": nproc}},
        }
        pod = {"nodeSelector": {"kubernetes.io/hostname": host}, "restartPolicy": "Never", "containers": [container]}
        spec = {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": pod}}
        jobs.append({"name": f"node-{k}", "replicas": 1, "template": {"spec": spec}})
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {"network": {"enableDNSHostnames": True, "subdomain": name}, "replicatedJobs": jobs},
    }


def write_launch(directory: str, hosts: list[str], nproc: int, config: str, image: str = "") -> list[str]:
    """hostfile, launch.sbatch and (with an image) jobset.json in `directory`; their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    hostfile = out / "hostfile"
    atomic_write(hostfile, "".join(f"{h}\n" for h in hosts))
    atomic_write(out / "launch.sbatch", sbatch_text(hosts, nproc, config, str(hostfile.resolve())))
    written = [str(hostfile), str(out / "launch.sbatch")]
    if image:
        atomic_write(out / "jobset.json", json.dumps(jobset(hosts, nproc, config, image), indent=1))
        written.append(str(out / "jobset.json"))
    return written
