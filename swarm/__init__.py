"""asyncrl.swarm — the swarm transport: how bytes and records move between peers over hivemind.

Used by both the coordinator and the volunteers; imports only `asyncrl.protocol` (tests/test_layering.py).
Who owns what:

  transport.py  SwarmNode: one hivemind DHT (forks, starts p2pd) + framed request/response P2P streams
  streams.py    every stream name (`asyncrl.<run>.<kind>`) in one place
  rate.py       TokenBucket: request rates (admission) and byte pacing (uploads)
  records.py    DHT records: the validator every node runs, the coordinator's pointer, sharded presence
  providers.py  the fetch sources the coordinator vouches for (probes, the signed providers record)
  serving.py    the `manifest` / `chunk` handlers and the AdapterStore a peer re-serves from
  fetch.py      SwarmFetcher: one version's manifest and chunks, from peers first, the coordinator last
  bootstrap.py  join addresses, whom to trust, re-dialling after an outage

Details and measurements: docs/transport.md.
"""
