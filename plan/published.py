"""Published training runs, and the run model's plan of each: the accuracy table of docs/plan.md.

Each row carries what its source states (model, devices, layout, batch, remat, measured
tokens/s per device, MFU and memory where given), what it leaves unstated and is assumed here
(``assumed``), and which of the run model's constants it was used to fit (``fitted``).

    for row in PUBLISHED_RUNS:
        print(row.name, planned(row)["tokens_per_s_per_device"] / row.tokens_per_s)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardfn.plan.layout import Layout
from shardfn.plan.runmodel import RunSpec, run_estimate

GIB = 1 << 30

TORCHTITAN_PERF = "pytorch/torchtitan docs/performance.md"
TORCHTITAN_PERF_2024 = "pytorch/torchtitan docs/performance.md (2024 edition, 64 A100)"
AUTOMODEL_PERF = ("NVIDIA-NeMo/Automodel docs/performance-summary.md @ 8d9bfb90e3d8, Pre-Training Performance, "
                  "DGX-H100 BF16; recipe examples/benchmark/configs/{}.yaml at that commit")
MEGATRON_BRIDGE_PERF = ("NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md, 26.04.01 NeMo Container, "
                        "Pre-Training, GPT OSS 120B, DGX-H100 BF16 row; recipe "
                        "scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py "
                        "GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V2 @ 17a381f95")
MOE_MODEL_ZOO_QWEN3 = ("yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md @ e8650517d60d, H100 table, "
                       "first cross-node EP row (Qwen3-235B-A22B, DeepEP, moe_dev f3e6c5)")
H100_BF16_TFLOPS = 989.0  # the NVIDIA rows' MFU: their model TFLOP/s over this (AutoModel's stated peak)

LLAMA2_13B = ["model.vocab_size=32000", "model.dim=5120", "model.n_layers=40", "model.n_heads=40",
              "model.n_kv_heads=40", "model.ffn_dim=13824", "model.rope_theta=10000.0"]
LLAMA2_70B = ["model.vocab_size=32000", "model.dim=8192", "model.n_layers=80", "model.n_heads=64",
              "model.n_kv_heads=8", "model.ffn_dim=28672", "model.rope_theta=10000.0"]
LLAMA3_70B = ["model.dim=8192", "model.n_layers=80", "model.n_heads=64", "model.n_kv_heads=8",
              "model.ffn_dim=28672"]
LLAMA3_405B = ["model.dim=16384", "model.n_layers=126", "model.n_heads=128", "model.n_kv_heads=8",
               "model.ffn_dim=53248"]


@dataclass(frozen=True)
class PublishedRun:
    """One published run: its source's numbers and the layout that reproduces it.

    Example:
        PublishedRun("Llama 3.1 8B", "llama3_1_8b", [], Layout(fsdp=8), 2, 8192, "selective_op",
                     "h100_96gb", 6667, source=TORCHTITAN_PERF)
    """

    name: str
    config: str
    model_overrides: list
    layout: Layout
    rows: int             # sequences per microbatch per data rank
    seq_len: int
    remat: str
    hardware: str
    tokens_per_s: float   # measured, per device
    mfu: float | None = None        # as the source computes it
    memory_gib: float | None = None  # as the source reports it (TorchTitan: max reserved)
    source: str = ""
    fitted: str = ""      # the constant this run fitted ("" : a check, not a fit)
    assumed: str = ""     # what the source does not say and this row assumes
    compile: bool = True  # torch.compile on (sources that do not say are planned compiled)
    known_gap: str = ""   # why the estimate misses this row by more than the target, when it does
    reshard_after_forward: bool = True  # FSDP gathers the weights again for the backward
    reference: bool = field(default=True)

    def load(self):
        """The run config of this row (the config file with the model, mesh, batch and remat set)."""
        from shardfn.config import load_config

        lay = self.layout
        overrides = [*self.model_overrides, f"mesh.pp={lay.pp}", f"mesh.dp={lay.dp}", f"mesh.fsdp={lay.fsdp}",
                     f"mesh.ep={lay.ep}", f"mesh.tp={lay.tp}", f"pipeline.microbatches={lay.microbatches}",
                     f"pipeline.schedule={lay.schedule}", f"train.seq_len={self.seq_len}",
                     f"train.batch_size={self.rows * lay.data_size * lay.microbatches}"]
        return load_config(self.config, overrides)


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("TorchTitan Llama 3.1 8B, 8 H100, FSDP 8, eager", "llama3_1_8b", [], Layout(fsdp=8), 2, 8192,
                 "selective_op", "h100_96gb", 5762, None, 82.4, f"{TORCHTITAN_PERF}, Table 1",
                 fitted="eager element-wise traffic (3.3)", compile=False),
    PublishedRun("TorchTitan Llama 3.1 8B, 8 H100, FSDP 8, compiled", "llama3_1_8b", [], Layout(fsdp=8), 2, 8192,
                 "selective_op", "h100_96gb", 6667, None, 77.0, f"{TORCHTITAN_PERF}, Table 1",
                 fitted="h100_96gb clock (0.63)"),
    PublishedRun("TorchTitan Llama 3.1 8B, 128 H100, FSDP 128, compiled", "llama3_1_8b", [], Layout(fsdp=128), 2,
                 8192, "selective_op", "h100_96gb", 6514, None, 62.0, f"{TORCHTITAN_PERF}, Table 3"),
    PublishedRun("TorchTitan Llama 3.1 405B, 128 H100, FSDP 16 x TP 8", "llama3_1_8b", LLAMA3_405B,
                 Layout(fsdp=16, tp=8), 2, 8192, "full", "h100_96gb", 109, 0.290, None,
                 f"{TORCHTITAN_PERF} (2024 edition, Llama 3.1 section; 94 GB H100)",
                 assumed="seq 8192 and the 500 W Grand Teton H100 of the later tables"),
    PublishedRun("TorchTitan Llama 3 8B, 64 A100, FSDP 64", "llama3_8b", [], Layout(fsdp=64), 1, 8192,
                 "selective_op", "a100", 2973, 0.582, None, TORCHTITAN_PERF_2024,
                 assumed="200 Gb/s HDR per GPU between nodes"),
    PublishedRun("TorchTitan Llama 3 70B, 64 A100, FSDP 64", "llama3_8b", LLAMA3_70B, Layout(fsdp=64), 1, 8192,
                 "full", "a100", 331, 0.517, None, TORCHTITAN_PERF_2024,
                 assumed="200 Gb/s HDR per GPU between nodes"),
    PublishedRun("TorchTitan Llama 2 13B, 64 A100, FSDP 64, no AC", "llama3_8b", LLAMA2_13B, Layout(fsdp=64), 2, 4096,
                 "none", "a100", 2162, 0.611, None, TORCHTITAN_PERF_2024,
                 assumed="200 Gb/s HDR per GPU between nodes",
                 known_gap="bound by the FSDP exchange over the assumed network, the estimate gives the same speed "
                           "with and without AC where the runs differ by 14%"),
    PublishedRun("TorchTitan Llama 2 13B, 64 A100, FSDP 64, selective op AC", "llama3_8b", LLAMA2_13B,
                 Layout(fsdp=64), 2, 4096, "selective_op", "a100", 1904, 0.538, None, TORCHTITAN_PERF_2024,
                 assumed="200 Gb/s HDR per GPU between nodes"),
    PublishedRun("TorchTitan Llama 2 70B, 64 A100, FSDP 64, full AC", "llama3_8b", LLAMA2_70B, Layout(fsdp=64), 2,
                 4096, "full", "a100", 353, 0.505, None, TORCHTITAN_PERF_2024,
                 assumed="200 Gb/s HDR per GPU between nodes"),
    PublishedRun("TorchTitan DeepSeek-V3 671B, 512 H100, FSDP 64 / EP 32 / PP 8", "deepseek_v3_671b", [],
                 Layout(pp=8, fsdp=2, ep=32, microbatches=8, schedule="interleaved_1f1b"), 1, 4096, "full", "h100",
                 346, 0.0983, None, "TorchTitan's DeepSeek-V3 671B results on 512 H100 (standard all-to-all)",
                 fitted="expert load imbalance (1.28)",
                 assumed="8 microbatches of one sequence per data rank, full AC, datasheet H100; shardfn's layout "
                         "shards dense weights over fsdp=2 where TorchTitan's FSDP spans 64 ranks"),
    PublishedRun("NeMo AutoModel DeepSeek-V3 671B, 256 H100, PP 4 / EP 64 / FSDP 64", "deepseek_v3_671b", [],
                 Layout(pp=4, ep=64, microbatches=8, schedule="interleaved_1f1b", virtual=8), 1, 4096, "full",
                 "h100", 1002, 250 / H100_BF16_TFLOPS, None, AUTOMODEL_PERF.format("deepseek_v3_te_deepep"),
                 assumed="8 microbatches of one sequence per step (local batch 8, no accumulation); TE kernels "
                         "without torch.compile, planned compiled; DeepEP, fake balanced gate; the source's FSDP "
                         "shards dense weights over the 64 ranks that hold the 64 expert shards, shardfn's ep axis "
                         "replicates them (fsdp=1)",
                 reshard_after_forward=False,
                 known_gap="the EP exchange dominates (1.23 of 1.92 s a microbatch: 64-way over 8 nodes, "
                           "recomputed, at 1.28x the mean load on a balanced run); memory: dense weights replicated "
                           "over ep (69 GiB)"),
    PublishedRun("NeMo AutoModel DeepSeek-V3 671B, 1024 H100, PP 4 / EP 64 / FSDP 256", "deepseek_v3_671b", [],
                 Layout(pp=4, fsdp=4, ep=64, microbatches=8, schedule="interleaved_1f1b", virtual=8), 1, 4096,
                 "full", "h100", 865, 216 / H100_BF16_TFLOPS, None,
                 AUTOMODEL_PERF.format("deepseek_v3_te_deepep_1024"),
                 assumed="8 microbatches of one sequence per pass, 4 passes accumulated (one planned); VP 8 as the "
                         "table states (the recipe's layers_per_stage 4 gives 4); TE kernels planned compiled; DeepEP, "
                         "fake balanced gate; FSDP over 256 ranks, shardfn's over fsdp=4 and replicated over ep=64",
                 reshard_after_forward=False,
                 known_gap="the EP exchange dominates (1.23 of 1.94 s a microbatch: 64-way over 8 nodes, recomputed, "
                           "at 1.28x the mean load on a balanced run)"),
    PublishedRun("NeMo AutoModel Kimi K2 1T, 256 H100, PP 8 / EP 32 / FSDP 32", "kimi_k2_1t", [],
                 Layout(pp=8, ep=32, microbatches=8, schedule="interleaved_1f1b", virtual=4), 1, 4096, "full",
                 "h100", 924, 189 / H100_BF16_TFLOPS, None, AUTOMODEL_PERF.format("kimi_k2_te_deepep"),
                 assumed="8 microbatches of one sequence per pass, 2 passes accumulated (one planned); TE kernels "
                         "planned compiled; DeepEP, fake balanced gate; the source's FSDP shards dense weights over "
                         "the 32 ranks that hold the 32 expert shards, shardfn's ep axis replicates them",
                 reshard_after_forward=False,
                 known_gap="the EP exchange dominates (0.52 of 0.82 s a microbatch: 32-way over 4 nodes, "
                           "recomputed, at 1.28x the mean load on a balanced run); memory: dense weights replicated "
                           "over ep (35 GiB)"),
    PublishedRun("NeMo AutoModel Qwen3-30B-A3B, 8 H100, EP 8 / FSDP 8", "qwen3_30b_a3b", [], Layout(ep=8), 4, 4096,
                 "full", "h100", 12040, 277 / H100_BF16_TFLOPS, None, AUTOMODEL_PERF.format("qwen3_moe_30b_te_deepep"),
                 assumed="4 sequences per pass, 16 passes accumulated (one planned); TE kernels planned compiled; "
                         "DeepEP, fake balanced gate; the source's FSDP shards dense weights over the 8 ranks that "
                         "hold the 8 expert shards, shardfn's ep axis replicates them",
                 reshard_after_forward=False,
                 known_gap="the EP exchange (0.49 of 1.63 s, 8-way on NVLink) at 1.28x the mean load on a balanced "
                           "run; memory: dense weights replicated over ep (23 GiB) and 4 sequences' fp32 logits "
                           "(23 GiB)"),
    PublishedRun("NeMo AutoModel gpt-oss-20b, 8 H100, EP 8 / FSDP 8", "gpt_oss_20b", [], Layout(ep=8), 2, 4096,
                 "full", "h100", 13058, 279 / H100_BF16_TFLOPS, None, AUTOMODEL_PERF.format("gptoss_20b_te_deepep"),
                 assumed="EP 8 as the recipe sets it (ep_size 8, DeepEP; the table's EP column reads -); 2 sequences "
                         "per pass, 16 passes accumulated (one planned); FlexAttention and TE kernels planned "
                         "compiled; fake balanced gate; dense weights replicated over ep where the source shards them "
                         "over FSDP 8",
                 reshard_after_forward=False,
                 known_gap="memory: dense weights replicated over ep (27 GiB of state, the 201k-row embedding and head "
                           "among them) where the source shards them over FSDP 8"),
    PublishedRun("NeMo AutoModel gpt-oss-120b, 64 H100, EP 64 / FSDP 64, no AC", "gpt_oss_120b", [], Layout(ep=64), 2,
                 4096, "none", "h100", 7626, 231 / H100_BF16_TFLOPS, None,
                 AUTOMODEL_PERF.format("gptoss_120b_te_deepep"),
                 assumed="EP 64 as the recipe sets it (ep_size 64, DeepEP; the table's EP column reads -); no AC "
                         "(activation_checkpointing false); 2 sequences per pass, 4 passes accumulated (one "
                         "planned); FlexAttention and TE kernels planned compiled; fake balanced gate; dense weights "
                         "replicated over ep where the source shards them over FSDP 64",
                 reshard_after_forward=False,
                 known_gap="the EP exchange dominates (0.77 of 1.33 s: 64-way over 8 nodes at 1.28x the mean load on "
                           "a balanced run); memory: activations without AC (40 GiB), dense weights over ep (32 GiB)"),
    PublishedRun("Megatron-Bridge gpt-oss-120b, 64 H100, PP 4 / EP 8", "gpt_oss_120b", [],
                 Layout(pp=4, dp=2, ep=8, microbatches=80), 1, 4096, "selective", "h100", 5824,
                 158 / H100_BF16_TFLOPS, None, MEGATRON_BRIDGE_PERF,
                 assumed="global batch 1280 as 80 microbatches of one sequence on 16 data ranks (dp=2 x ep=8), one "
                         "1F1B flush; recompute of the norms and the MoE activation as shardfn's selective (matmul "
                         "outputs kept); the distributed optimizer's sharded state not modelled; TE kernels planned "
                         "compiled; forced-balanced routing",
                 known_gap="planned compute-bound (0.09 of 0.10 s a microbatch, 33% MFU) where the source reports "
                           "158 TFLOP/s, below AutoModel's 231 on the same model and GPUs; memory: optimizer state "
                           "unsharded"),
    PublishedRun("Megatron-Core Qwen3-235B-A22B, 256 H100, PP 8 / EP 32 / attention TP 2", "qwen3_235b_a22b", [],
                 Layout(pp=8, ep=32, microbatches=64, schedule="interleaved_1f1b", virtual=4), 1, 4096, "selective",
                 "h100", 2048 * 4096 / 19.7 / 256, 245 / H100_BF16_TFLOPS, None, MOE_MODEL_ZOO_QWEN3,
                 assumed="tokens/s from the stated 19.7 s step of 2048 x 4096 tokens; MoE parallel folding (attention "
                         "TP 2 x DP 16, experts EP 32 on the same ranks) planned as ep=32 without tp: the same tokens "
                         "per GPU per step, in 64 microbatches of a sequence instead of 128 of half one; recompute of "
                         "norms and activations as selective; the distributed optimizer not modelled; TE kernels "
                         "planned compiled; DeepEP; routing balance not stated for this row",
                 known_gap="the EP exchange dominates (0.30 of 0.48 s a microbatch: 32-way over 4 nodes at 1.28x "
                           "the mean load); memory: whole-sequence activations (74 GiB) where the source's TP 2 holds "
                           "halves"),
)
"""The runs docs/plan.md's table checks; three of them fitted the run model's three free constants."""


def planned(row: PublishedRun) -> dict:
    """The run model's estimate of ``row``'s layout (``plan.runmodel.run_estimate``).

        planned(PUBLISHED_RUNS[0])["tokens_per_s_per_device"]    # ~6,700
    """
    return run_estimate(row.load(), row.layout, hardware=row.hardware,
                        spec=RunSpec(remat=row.remat, rows=row.rows, compile=row.compile,
                                     reshard_after_forward=row.reshard_after_forward))


def table_rows() -> list[dict]:
    """Every published run with its plan and the ratios planned / measured."""
    out = []
    for row in PUBLISHED_RUNS:
        est = planned(row)
        tps = est["tokens_per_s_per_device"]
        mem = est["memory"]["reserved_bytes"] / GIB
        out.append({"name": row.name, "tokens_per_s": row.tokens_per_s, "planned_tokens_per_s": tps,
                    "tokens_ratio": tps / row.tokens_per_s, "mfu": row.mfu, "planned_mfu": est["mfu"],
                    "memory_gib": row.memory_gib, "planned_memory_gib": mem,
                    "memory_ratio": mem / row.memory_gib if row.memory_gib else None,
                    "fitted": row.fitted, "assumed": row.assumed, "source": row.source,
                    "known_gap": row.known_gap})
    return out


if __name__ == "__main__":
    for r in table_rows():
        mem = f"{r['planned_memory_gib']:.1f}/{r['memory_gib']} ({r['memory_ratio']:.2f})" if r["memory_gib"] else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
        print(f"{r['name']:<70} {r['planned_tokens_per_s']:>8,.0f} / {r['tokens_per_s']:>6,.0f} "
              f"({r['tokens_ratio']:.2f})  mfu {r['planned_mfu']:.1%} / {mfu}  mem {mem}")
