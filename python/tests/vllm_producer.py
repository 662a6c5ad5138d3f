"""An encode-only vLLM instance's ECXConnector pair in its own process, driven over
stdin in the order vLLM's scheduler and model runner call the hooks:
    encode <request_id> <mm_hash>:<seed>:<d0,d1> ...  -> ec_transfer_params JSON
    pins                                              -> the producer pool's pin count
"""
import json
import sys

from vllm_support import connectors, empty_step, request, tensor


def main() -> None:
    scheduler, worker = connectors("ec_producer", json.loads(sys.argv[1]))
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "pins":
            stats = scheduler._shared.conn.stats()
            print(stats["producer_pool"]["pins"], flush=True)
            continue
        items = [w.split(":") for w in words[2:]]
        req = request(words[1], [(h, int(d.split(",")[0])) for h, _, d in items])
        for i in range(len(items)):
            scheduler.update_state_after_alloc(req, i)
        step = empty_step()
        step.ec_connector_metadata = scheduler.build_connector_meta(step)
        worker.bind_connector_metadata(step.ec_connector_metadata)
        cache = {}
        for mm_hash, seed, dims in items:  # the encoder runs, then the runner saves
            cache[mm_hash] = tensor(int(seed), [int(d) for d in dims.split(",")])
            worker.save_caches(encoder_cache=cache, mm_hash=mm_hash)
        worker.get_finished(set())
        worker.clear_connector_metadata()
        _, params = scheduler.request_finished(req)
        print(json.dumps(params), flush=True)


if __name__ == "__main__":
    main()
