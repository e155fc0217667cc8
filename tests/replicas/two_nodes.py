"""Two Ray "nodes" on one machine (``ray.cluster_utils.Cluster``: a head and two more raylets,
each of the two with one fake GPU), and a replicated deployment on them: each replica's
placement group takes one node's GPU, so the two engines run on different raylets; requests
are served through the one frontend. Run as a script (a process holds one Ray connection, and
the test session already holds its own): prints one JSON line with what it saw.

    python -m tests.replicas.two_nodes MODEL_DIR
"""

from __future__ import annotations

import json
import sys


def main(model: str) -> int:
    import ray
    from ray.cluster_utils import Cluster

    import ninfer
    from ninfer.actors.ray_actors import NAMESPACE

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0,
                                                             "object_store_memory": 100 << 20})
    nodes = [cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=100 << 20) for _ in range(2)]
    cluster.wait_for_nodes()
    out: dict = {"raylets": len(ray.nodes()) if ray.is_initialized() else None}
    eng = ninfer.Engine.start(model, config={"max_concurrency": 2, "max_context": 256, "cost_calibration": False},
                              dtype="float64", transport="ray", address=cluster.address, deployment="two-nodes",
                              replicas=2)
    try:
        out["raylets"] = len([n for n in ray.nodes() if n["Alive"]])
        out["gpu_nodes"] = sorted(n.node_id for n in nodes)
        reps = ray.get(eng._rt.frontend.replica_info.remote())
        out["replica_nodes"] = sorted(r["node"] for r in reps)
        workers = [ray.get_actor(f"two-nodes-r{r['key']}-worker", namespace=NAMESPACE) for r in reps]
        out["worker_nodes"] = sorted(ray.get([w.channel_address.remote() for w in workers])[i][1]
                                     for i in range(len(workers)))
        prompts = [[(7 * i + 3 * j) % 1500 + 1 for j in range(40)] for i in range(4)]
        out["prompts"] = prompts
        outs = [h.result(300) for h in [eng.generate(p, max_tokens=4, ignore_eos=True) for p in prompts]]
        out["finish"] = [o.finish_reason for o in outs]
        out["tokens"] = [o.token_ids for o in outs]
        out["spread"] = sorted(r["finished"] for r in eng.stats()["replicas"])
    finally:
        eng.shutdown()
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
