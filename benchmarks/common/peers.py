"""The KV transfer configs of every system the benchmarks set beside each other: this
connector (embedded tiers, an L2 adapter, or an `lmcache server`), vLLM's
OffloadingConnector (alone or with its fs tier), and LMCache's MP connector.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gemma4_kv.tools.harness import connector_config


def transfer_config(args, layout, stats: Path) -> dict:
    """`--kv-transfer-config` of `args.connector` (gemma4-kv, offloading, offloading-fs or
    lmcache-mp) with `args`' tier sizes, writing our stats to `stats`."""
    if args.connector == "gemma4-kv":
        if args.server:  # every setting at its default but the server's URL
            return connector_config({"lmcache_server": args.server,
                                     "stats_file": str(stats)})
        extra = {"cpu_gb": args.cpu_gb, "stats_file": str(stats)}
        if args.l2:
            extra.update(l2_adapters=json.loads(args.l2), lookup_timeout_s=60.0,
                         l2_codec=args.codec)
        return connector_config(extra)
    if args.connector == "lmcache-mp":
        return {"kv_connector": "LMCacheMPConnector",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.server_urls": args.server}}
    cpu_bytes = int(args.cpu_gb * (1 << 30))
    if shutil.disk_usage("/dev/shm").free < cpu_bytes:
        # Its shared /dev/shm region does not fit on this machine: private pinned
        # tensors per worker instead (vLLM's own fallback path).
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

        CPUOffloadingSpec._uses_shared_region = lambda self: False
    largest_block = max(g.block_size for g in layout.groups)
    extra = {"cpu_bytes_to_use": cpu_bytes,
             "blocks_per_chunk": 256 // largest_block,  # 256-token hits, like ours
             "sync_load_budget_bytes": 1 << 36}  # load in the hit's own step, like ours
    if args.connector == "offloading-fs":
        extra.update(spec_name="TieringOffloadingSpec",
                     secondary_tiers=[{"type": "fs", "root_dir": args.fs_dir}])
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}
