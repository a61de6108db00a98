#!/usr/bin/env python3
"""The peer's number for the same job: timm ViT training-step throughput with PyTorch, to run
side by side with `vitgrid bench` (same model, batch, precision, AdamW step included).

    python3 tools/bench_pytorch.py --model vit_base_patch16_224 --batch 256 --precision bf16 [--compile]
    python3 tools/bench_pytorch.py --model vit_lite_7_4 --img 32 --classes 10 --batch 512   # ViT-Lite-7/4
    torchrun --nproc_per_node 4 tools/bench_pytorch.py ... --ddp      # DistributedDataParallel
    torchrun ... --ddp --ddp-bf16-hook   # gradients all-reduced in bf16 (DDP's bf16_compress_hook)
    ... --grad-checkpointing --drop-path 0.1   # timm's activation checkpointing, stochastic depth
    ... --precision bf16 --float8 --compile   # torchao's float8 training (tensorwise scaling) on
                                              # the blocks' Linears (vitgrid's precision.mode = fp8)

Prints one line: model, precision, mode, world, img/s (global), img/s per GPU, step ms, peak
memory (GiB, torch.cuda.max_memory_allocated)."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tool_deps  # noqa: E402
# third-party modules: checked after argument parsing (tool_deps.require), so --help needs none
try:
    import torch
    import torch.nn.functional as F
except ImportError:
    pass


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--batch", type=int, default=256, help="per GPU")
    ap.add_argument("--img", type=int, default=224)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32", "tf32"])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--ddp-bf16-hook", action="store_true",
                    help="DDP reduces the gradients in bf16 (vitgrid's parallel.grad_reduce = act)")
    ap.add_argument("--grad-checkpointing", action="store_true",
                    help="timm's set_grad_checkpointing (vitgrid's model.checkpoint_activations)")
    ap.add_argument("--drop-path", type=float, default=0.0,
                    help="timm's drop_path_rate (vitgrid's model.drop_path)")
    ap.add_argument("--float8", action="store_true",
                    help="torchao's convert_to_float8_training (tensorwise scaling) on the blocks' "
                         "Linears, as vitgrid's precision.mode = fp8 (head and patch embedding stay)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    tool_deps.require("bench_pytorch", "torch", "timm")
    import timm

    rank, world = 0, 1
    if a.ddp:
        torch.distributed.init_process_group("nccl")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = a.precision == "tf32"
    if a.model == "vit_lite_7_4":  # Colossal-AI's CIFAR-10 ViT-Lite-7/4 (not a timm name)
        from timm.models.vision_transformer import VisionTransformer
        model = VisionTransformer(img_size=a.img, patch_size=4, embed_dim=256, depth=7, num_heads=4,
                                  mlp_ratio=2.0, num_classes=a.classes,
                                  drop_path_rate=a.drop_path).cuda()
    else:
        model = timm.create_model(a.model, num_classes=a.classes, img_size=a.img,
                                  drop_path_rate=a.drop_path).cuda()
    if a.grad_checkpointing:
        model.set_grad_checkpointing(True)
    if a.float8:
        tool_deps.require("bench_pytorch --float8", "torchao")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(
            model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
            module_filter_fn=lambda m, fqn: fqn.startswith("blocks.") and isinstance(m, torch.nn.Linear))
    if a.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
        if a.ddp_bf16_hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, fused=True)
    fwd = torch.compile(model) if a.compile else model
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)
    scaler = torch.cuda.amp.GradScaler(enabled=a.precision == "fp16")
    x = torch.randn(a.batch, 3, a.img, a.img, device="cuda")
    y = torch.randint(0, a.classes, (a.batch,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(fwd(x), y, label_smoothing=0.1)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / a.steps
    mem = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        mode = ("ddp " if a.ddp else "") + ("bf16-hook " if a.ddp_bf16_hook else "") + \
            ("checkpointing " if a.grad_checkpointing else "") + ("torchao float8 " if a.float8 else "") + \
            (f"drop path {a.drop_path} " if a.drop_path else "") + \
            ("torch.compile" if a.compile else "eager")
        print(f"pytorch | {a.model} | {a.precision} | {mode} | world {world} | batch/GPU {a.batch} | "
              f"step {dt * 1e3:.2f} ms | {world * a.batch / dt:.1f} img/s | {a.batch / dt:.1f} img/s/device | "
              f"peak mem {mem:.2f} GiB | torch {torch.__version__} timm {timm.__version__}", flush=True)
    if a.ddp:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
