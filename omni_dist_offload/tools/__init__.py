"""Developer tools, each runnable with ``python -m omni_dist_offload.tools.<name>``:

* :mod:`.bench`: resident, diffusers group offloading and this project side by side
  (``omni-offload bench``);
* :mod:`.soak`: many forwards at two shapes: memory drift and parity;
* :mod:`.startup`: start-up time and peak host memory (cold start, load whole, the peer);
* :mod:`.trace_blocks`: per-rank, per-block compute under each weight transfer;
* :mod:`.timeline`: the benchmark's charts;
* :mod:`.serve_stress`: ``omni-offload serve`` under load and abuse (stalled uploads), over HTTP.
"""
