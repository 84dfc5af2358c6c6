"""torchrun entry point: data-parallel generation with a layerwise-offloaded pipeline.

One process per GPU. Prompts (``--prompt``, repeatable, or ``--prompts-file``, one a line) are
shared across the ranks; prompt k gets seed ``--seed`` + k and is written as
``<output-dir>/<k:05d>.{png,mp4,gif}`` with a ``<k:05d>.json`` sidecar by the rank that made it. With
rank-local or shared weights each rank takes the next prompt when free; under ``allgather`` all
ranks run the same pipeline calls in waves of one prompt per rank (the last padded with repeats
whose outputs are dropped); with ``--ulysses-degree``/``--ring-degree`` each group of that many
ranks splits one prompt's sample (context parallelism), in waves of one prompt per group.
Rank 0 shows progress and ends with a line reporting images or videos per minute. Every flag of
``omni-offload generate`` works here; with none, the built-in tiny-wan runs.

    # 8 GPUs of one host: Wan 2.2 A14B, both DiTs and the text encoder streamed
    torchrun --nproc_per_node 8 launch/generate.py \\
        --model Wan-AI/Wan2.2-T2V-A14B-Diffusers \\
        --diffusion-offload-config '{"mode":"layer","components":["dit","text_encoder"]}' \\
        --prompts-file prompts.txt --num-inference-steps 40 --output-dir out/

    # each rank keeping a 1/8 shard of the DiT in host memory, all-gathered block by block
    torchrun --nproc_per_node 8 launch/generate.py --model Wan-AI/Wan2.2-T2V-A14B-Diffusers \\
        --diffusion-offload-config '{"mode":"layer","components":["dit"],"layer_options":{"dit":{"weight_transfer":"allgather"}}}' \\
        --prompts-file prompts.txt

    # the same through the wrapper (NGPU and LOG_RANK overridable, NVLink multicast off)
    NGPU=8 launch/generate.sh --model Wan-AI/Wan2.2-T2V-A14B-Diffusers --prompts-file prompts.txt

    # two hosts of 8 GPUs: run on each, with --node-rank 0 on 10.0.0.1 and 1 on the other
    torchrun --nnodes 2 --node-rank 0 --nproc_per_node 8 --master-addr 10.0.0.1 \\
        --master-port 29500 launch/generate.py --prompts-file prompts.txt

    # one sample over two GPUs (diffusers' context parallelism): groups of 2 ranks, a prompt each
    torchrun --nproc_per_node 4 launch/generate.py --model Wan-AI/Wan2.1-T2V-14B-Diffusers \\
        --ulysses-degree 2 --height 720 --width 1280 --num-frames 81 --prompts-file prompts.txt

    # ring attention needs a backend that returns the log-sum-exp, set through diffusers' variable
    DIFFUSERS_ATTN_BACKEND=flash torchrun --nproc_per_node 2 launch/generate.py --ring-degree 2 \\
        --model Wan-AI/Wan2.1-T2V-14B-Diffusers --prompts-file prompts.txt

    # CPU smoke run: two processes (gloo), built-in tiny-wan, four prompts
    python -m torch.distributed.run --nproc_per_node 2 launch/generate.py \\
        --prompt "a red fox" --prompt "a cat" --prompt "a dog" --prompt "a bird" --output-dir out/
"""

import sys
from pathlib import Path

# The checkout this script is in comes first, as launch/bench.sh and serve.sh put it (and as a
# checkout that was not pip-installed needs): an installed copy of another version must not run
# in its place.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_dist_offload.app.cli import main  # noqa: E402 - after the path is set
from omni_dist_offload.runtime.proc import exit_with  # noqa: E402


if __name__ == "__main__":
    exit_with(main, ["generate", *sys.argv[1:]])
