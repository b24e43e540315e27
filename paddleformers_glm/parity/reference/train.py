"""The torch reference training run that ``glm52 train`` must reproduce (``glm52 align`` runs both):
``python -m paddleformers_glm.parity.reference.train --model DIR --out OUT [training flags]``.

HF transformers' ``GlmMoeDsaForCausalLM`` plus the MTP layers it drops, assembled from HF's own
modules; every rule of a training step is written out here independently of the Paddle trainer,
from the contract it documents (docs/parity.md, "What the reference does in a step"). The data are
the trainer's own numpy sources, so both runs read the same token ids. Writes ``OUT/loss.json`` in
the trainer's schema and the ``--dump-step`` dumps in the checkpoint's official names.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import time

from ..._io import read_json, write_record
from ...modeling.indexer_stages import check_warmup_flags
from ...train.command import (
    add_dtype_argument,
    add_dump_argument,
    add_indexer_arguments,
    add_step_arguments,
    dump_steps,
)
from ...train.settings import check_numbers, effective_min_lr, indexer_stage_weight, recorded_settings
from .indexer import ReferenceIndexer, saved_indexer_coeff
from .topk_gaps import GapMonitor

DUMP_KINDS = ("grads", "exp_avg", "exp_avg_sq", "weights")
# an MTP layer's own modules -> their checkpoint names (``model.layers.{L+j}.<name>.weight``)
MTP_HEAD = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head_norm": "shared_head.norm"}


def lr_at(step: int, max_lr: float, min_lr: float, warmup: int, total: int) -> float:
    """LR of update ``step`` (1-based): linear warmup, then cosine down to ``min_lr`` at ``total``."""
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="torch reference training run (HF transformers + MTP), one process")
    ap.add_argument("--model", required=True, help="checkpoint folder (official HF layout)")
    add_step_arguments(ap)
    add_indexer_arguments(ap)
    ap.add_argument("--data", help=".npy / .bin / .jsonl (default: synthetic)")
    ap.add_argument("--data-dtype", default="auto")
    ap.add_argument("--out", required=True)
    add_dump_argument(ap)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: reproducible)")
    add_dtype_argument(ap, "HF's dtype policy: the routers and correction biases fp32")
    args = ap.parse_args(argv)
    try:  # glm52 train's own checks of the numbers, the warm-up's flags and the DIR K pairs
        check_numbers(args)
        check_warmup_flags(args.indexer_stage, args.moe_bias_update_rate, getattr(args, "moe_aux_loss_coeff", 0.0))
        args.dump_step = dump_steps(args)
    except ValueError as e:
        ap.error(str(e))
    if args.global_batch_size % args.micro_batch_size:  # glm52 train's check_batch with one replica
        ap.error("--global-batch-size must be divisible by --micro-batch-size")
    if args.steps < 1:  # glm52 train --steps 0 only evaluates; a reference run is its updates
        ap.error(f"--steps must be at least 1 (the reference records its training steps), got {args.steps}")
    return args


# ----------------------------------------------------------------------------------------------
# checkpoint (official layout) <-> HF modules


def read_checkpoint(model_dir: str, layers: int) -> dict:
    """The checkpoint's tensors of the model's ``layers`` decoder layers (main + MTP) and the rest,
    as fp32 torch tensors (tiny models only), read through the same validating reader the Paddle
    loader uses (bf16 widened bit-exactly).  An MTP layer the config turns off
    (``num_nextn_predict_layers``) is left out, as the Paddle model builds and dumps none."""
    import torch

    from ...checkpoint.safetensors_io import Checkpoint, bf16_bits_to_float32

    def built(name: str) -> bool:
        part = name.split(".")
        return not (name.startswith("model.layers.") and part[2].isdigit() and int(part[2]) >= layers)

    with Checkpoint(model_dir, strict=False) as ckpt:
        return {
            k: torch.from_numpy(bf16_bits_to_float32(a) if i.dtype == "BF16" else a.astype("float32"))
            for k, i in ckpt.tensors.items()
            if built(k)
            for a in [ckpt.numpy(k)]
        }


def _layer_state(state: dict, prefix: str, num_experts: int, drop_indexer: bool) -> dict:
    """Keys of one decoder layer relative to it, per-expert tensors fused as HF 5.x stores them."""
    import torch

    sd = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if drop_indexer:
        sd = {k: v for k, v in sd.items() if ".indexer." not in k}
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    if "mlp.experts.0.gate_proj.weight" in sd:
        w = [{n: sd[f"mlp.experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down")} for e in range(num_experts)]
        out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]], 0) for x in w]).contiguous()
        out["mlp.experts.down_proj"] = torch.stack([x["down"] for x in w]).contiguous()
    return out


def _unfuse(name: str, t, inter: int) -> list[tuple[str, object]]:
    """HF tensor name (relative to a layer) -> official per-expert names."""
    if name.endswith("mlp.experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        halves = (("gate", slice(None, inter)), ("up", slice(inter, None)))
        return [(f"{base}{e}.{n}_proj.weight", t[e, part]) for e in range(t.shape[0]) for n, part in halves]
    if name.endswith("mlp.experts.down_proj"):
        base = name[: -len("down_proj")]
        return [(f"{base}{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
    return [(name, t)]


class Reference:
    """HF main model + hand-assembled MTP layers, with the official name of every parameter."""

    def __init__(self, args: argparse.Namespace) -> None:
        """``args`` of :func:`parse_args`: ``--model``, ``--dtype`` and the indexer flags."""
        import torch
        from torch import nn
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm

        self.model_dir = model_dir = args.model
        self.conf = conf = GlmMoeDsaConfig.from_pretrained(model_dir)
        conf._attn_implementation = "eager"
        L, E, H = conf.num_hidden_layers, conf.n_routed_experts, conf.hidden_size
        self.L, self.inter = L, conf.moe_intermediate_size
        self.D = int(getattr(conf, "num_nextn_predict_layers", 0) or 0)
        raw = read_json(os.path.join(model_dir, "config.json"), "the model config")
        self.mtp_weight = float(raw.get("mtp_loss_scaling_factor", getattr(conf, "mtp_loss_scaling_factor", 0.1)))
        self.indexer_stage, self.indexer_coeff = indexer_stage_weight(
            args.indexer_stage, args.indexer_loss_coeff, saved_indexer_coeff(model_dir)
        )
        self.indexer_shared = bool(args.indexer_shared_supervision)
        self.share_topk = bool(conf.index_share_for_mtp_iteration)
        self.ckpt = read_checkpoint(model_dir, L + self.D)
        torch.manual_seed(0)
        self.model = GlmMoeDsaForCausalLM(conf).to(torch.float32)
        hf = {k: v for k, v in self.ckpt.items() if not k.startswith("model.layers.")}
        for i in range(L):
            for k, v in _layer_state(self.ckpt, f"model.layers.{i}.", E, drop_indexer=False).items():
                hf[f"model.layers.{i}.{k}"] = v
        self.model.load_state_dict(hf, strict=True)
        mtp_conf = GlmMoeDsaConfig.from_pretrained(
            model_dir,
            num_hidden_layers=L + self.D,
            indexer_types=list(conf.indexer_types) + ["shared" if self.share_topk else "full"] * self.D,
            mlp_layer_types=list(conf.mlp_layer_types) + ["sparse"] * self.D,
        )
        mtp_conf._attn_implementation = "eager"
        mtp_conf._experts_implementation = self.model.config._experts_implementation  # as the main layers
        self.mtp = nn.ModuleList()
        eps = conf.rms_norm_eps
        for j in range(self.D):
            m = nn.ModuleDict(
                {
                    "enorm": GlmMoeDsaRMSNorm(H, eps),
                    "hnorm": GlmMoeDsaRMSNorm(H, eps),
                    "eh_proj": nn.Linear(2 * H, H, bias=False),
                    "layer": GlmMoeDsaDecoderLayer(mtp_conf, L + j),
                    "shared_head_norm": GlmMoeDsaRMSNorm(H, eps),
                }
            )
            p = f"model.layers.{L + j}."
            with torch.no_grad():
                for mod, key in MTP_HEAD.items():
                    m[mod].weight.copy_(self.ckpt[f"{p}{key}.weight"])
            heads = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
            sd = _layer_state(self.ckpt, p, E, drop_indexer=self.share_topk)
            m["layer"].load_state_dict({k: v for k, v in sd.items() if not k.startswith(heads)}, strict=True)
            self.mtp.append(m)
        if args.dtype == "bfloat16":
            self._to_bf16()
        self._taps: dict = {}
        self.model.model.norm.register_forward_hook(lambda mod, a, out: self._taps.__setitem__("h0", out))
        self.model.model.layers[0].register_forward_pre_hook(self._pre, with_kwargs=True)
        self.model.model.layers[-1].register_forward_hook(lambda mod, a, out: self._taps.__setitem__("topk", out[1]))
        # MoE layer number (the MTP layers after the decoder layers) -> (its decoder layer, its router)
        layers = list(enumerate(self.model.model.layers))
        layers += [(L + j, m["layer"]) for j, m in enumerate(self.mtp)]
        self.routers = {i: layer.mlp.gate for i, layer in layers if hasattr(layer.mlp, "gate")}
        self.num_experts = E
        self.load: dict[int, object] = {}  # this step's (token, k) assignments per expert, per MoE layer
        self._valid: dict[int, object] = {}  # MoE layer -> its routed rows' real tokens [B * S] bool (this forward)
        for i, gate in self.routers.items():
            gate.register_forward_hook(lambda mod, a, out, i=i: self._count(i, out[2]))
        # the indexer's training (its KL and recall per layer that runs its own indexer): parity/reference/indexer.py
        self.indexer = ReferenceIndexer(layers, self.indexer_stage, self.indexer_shared)

    def _count(self, layer: int, topk_indices) -> None:
        import torch

        valid = self._valid.get(layer)
        if valid is not None:  # only real tokens count (docs/model.md, "MoE balancing")
            topk_indices = topk_indices[valid]
        c = torch.bincount(topk_indices.reshape(-1), minlength=self.num_experts).to(torch.float64)
        self.load[layer] = c if layer not in self.load else self.load[layer] + c

    def update_router_biases(self, rate: float) -> None:
        """The expert-bias rule after an optimizer step (docs/model.md, "MoE balancing"), in float32."""
        import numpy as np
        import torch

        r = np.float32(rate)
        with torch.no_grad():
            for i, gate in self.routers.items():
                load = self.load[i].numpy()  # exact integer counts (float64)
                sign = np.sign(load.sum() / self.num_experts - load).astype(np.float32)
                bias = gate.e_score_correction_bias
                new = (bias.detach().numpy().astype(np.float32) + r * sign).astype(np.float32)
                bias.copy_(torch.from_numpy(new))

    def take_idle_experts(self) -> dict[str, list[int]]:
        """MoE layer -> the experts no token reached this step (layers with any); resets the counts."""
        idle = {str(i): [int(e) for e in (self.load[i] == 0).nonzero().reshape(-1).tolist()] for i in sorted(self.load)}
        self.load = {}
        return {k: v for k, v in idle.items() if v}

    def _to_bf16(self) -> None:
        """bf16 weights, as HF's ``from_pretrained(dtype=bfloat16)`` gives them, except the routers'
        weights, kept fp32 like the correction bias (the official ``moe_router_dtype``, and the
        Paddle model's: HF's router computes in fp32 from a bf16 weight, the same values at load)."""
        import torch
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

        for mod in (self.model, self.mtp):
            routers = [m for m in mod.modules() if isinstance(m, GlmMoeDsaTopkRouter)]
            keep = [(m.weight.data.clone(), m.e_score_correction_bias.clone()) for m in routers]
            mod.to(torch.bfloat16)
            for m, (w, b) in zip(routers, keep):
                m.weight.data = w
                m.e_score_correction_bias = b

    def _pre(self, mod, args, kwargs):
        self._taps["kw"] = {k: kwargs[k] for k in ("attention_mask", "position_embeddings", "position_ids")}

    def named_parameters(self) -> list[tuple[str, object]]:
        """(HF-style unique name, parameter): main model names, MTP under ``mtp.{j}.``."""
        return [*self.model.named_parameters(), *((f"mtp.{n}", p) for n, p in self.mtp.named_parameters())]

    def router_biases(self) -> list[tuple[str, object]]:
        """(HF-style unique name, buffer) of every router's correction bias (moved by the bias updates)."""
        buffers = [*self.model.named_buffers(), *((f"mtp.{n}", b) for n, b in self.mtp.named_buffers())]
        return [(n, b) for n, b in buffers if n.endswith("e_score_correction_bias")]

    def official(self, name: str, t) -> list[tuple[str, object]]:
        """Official checkpoint names (and views) of one parameter-shaped tensor."""
        if name.startswith("mtp."):
            j, rest = name[4:].split(".", 1)
            p = f"model.layers.{self.L + int(j)}."
            head = rest.removesuffix(".weight")
            if head in MTP_HEAD:
                return [(f"{p}{MTP_HEAD[head]}.weight", t)]
            assert rest.startswith("layer."), rest
            return [(p + k, v) for k, v in _unfuse(rest[len("layer.") :], t, self.inter)]
        return _unfuse(name, t, self.inter)

    def forward_losses(self, ids, labels, mask):
        """(lm loss sum, [MTP loss sum per depth], token counts are the caller's) for one micro-batch."""
        import torch
        import torch.nn.functional as F

        B, S = ids.shape
        # the real tokens each router counts: the mask, and for MTP depth d position i, token i + d too
        # (0 past the end of the window), the rule of modeling/mtp.py's mtp_token_valid
        self._valid = {}
        m = mask.bool() if mask is not None else torch.ones(B, S, dtype=torch.bool)
        if mask is not None:
            self._valid = {i: m.reshape(-1) for i in self.routers if i < self.L}
        for d in range(1, len(self.mtp) + 1):  # with or without a mask: the window's last d are not real
            ahead = torch.cat([m[:, min(d, S) :], m.new_zeros(B, min(d, S))], dim=1)
            self._valid[self.L + d - 1] = (m & ahead).reshape(-1)
            self.indexer.query_valid[self.L + d - 1] = m & ahead  # its own indexer's KL and recall count these
        out = self.model(input_ids=ids, attention_mask=mask, use_cache=False)

        def ce_sum(logits, shift):
            target = torch.full_like(labels, -100)
            if shift < S:  # a depth past the window has no target (S - shift would slice from the end)
                target[:, : S - shift] = labels[:, shift:]
            return F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
            )

        lm = ce_sum(out.logits, 1)
        h, kw = self._taps["h0"], self._taps["kw"]
        mtps = []
        for d, m in enumerate(self.mtp, start=1):
            tokens = torch.cat([ids[:, d:], ids.new_zeros(B, min(d, S))], dim=1)[:, :S]
            e = self.model.model.embed_tokens(tokens)
            x = m["eh_proj"](torch.cat([m["enorm"](e), m["hnorm"](h)], dim=-1))
            top = self._taps["topk"] if self.share_topk else None
            h, _ = m["layer"](x, **kw, past_key_values=None, use_cache=False, prev_topk_indices=top)
            mtps.append(ce_sum(self.model.lm_head(m["shared_head_norm"](h)), d + 1))
        return lm, mtps


# ----------------------------------------------------------------------------------------------
# dumps


def write_dump(ref: Reference, out_dir: str, tensors: dict[str, dict]) -> None:
    """``tensors[kind][official name]`` -> ``out_dir/kind/model.safetensors`` (+ config.json copy).

    Every key of the checkpoint is written: a tensor the run does not train (an unused indexer, the
    router's correction bias) gets its checkpoint value as weight and zeros as gradient/moments.
    """
    import torch
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    for kind in DUMP_KINDS:
        have = tensors[kind]
        full = {}
        for k, v in ref.ckpt.items():
            if k in have:
                full[k] = have[k].detach().to(torch.float32).contiguous().clone()
            else:
                full[k] = v.clone() if kind == "weights" else torch.zeros_like(v)
        if extra := sorted(set(have) - set(ref.ckpt)):
            raise RuntimeError(f"dump {kind}: names not in the checkpoint: {extra[:5]}")
        d = os.path.join(out_dir, kind)
        tmp = d + f".part.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_file(full, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(os.path.join(ref.model_dir, "config.json"), os.path.join(tmp, "config.json"))
        shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)


# ----------------------------------------------------------------------------------------------
# training


def train(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch
    import transformers

    from paddleformers_glm.train.data import micro_batches, open_data

    torch.set_num_threads(max(1, args.threads))
    torch.manual_seed(args.seed)
    ref = Reference(args)
    ref.model.train()
    ref.mtp.train()
    model_params = ref.named_parameters()
    if ref.indexer_stage == "warmup":  # only the indexers train: the rest takes no gradient, has no state
        for n, p in model_params:
            p.requires_grad_(".indexer." in n)
    trained = [(n, p) for n, p in model_params if p.requires_grad]
    # the optimizer steps fp32 masters of bf16 parameters (an fp32 parameter is its own master);
    # gradients accumulate into the masters in fp32, micro-batch by micro-batch
    params = [(n, p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True)) for n, p in trained]
    low = [(p, m) for (_, p), (_, m) in zip(trained, params) if p is not m]
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    data = open_data(args.data, args.seq_len, ref.conf.vocab_size, args.seed, data_dtype=args.data_dtype)
    min_lr = effective_min_lr(args.lr, args.min_lr)
    hist: dict[str, list[float]] = {"losses": [], "mtp_losses": [], "grad_norms": [], "lrs": []}
    if ref.indexer_stage != "none":
        hist["indexer_losses"] = []
    kl_rows: list[list[float]] = []  # [step][layer], ref.indexer.layers in order
    recall_rows: list[list[float]] = []
    idle_experts: list[dict[str, list[int]]] = []
    margins = GapMonitor(min_gap=None)  # the same hooks as the fixtures' tie screening
    margins.attach(ref.model)
    margins.attach(ref.mtp)
    gaps: list[dict] = []
    dumps: dict[int, list[str]] = {}
    for d, k in args.dump_step:
        dumps.setdefault(k, []).append(d)
    G, M = args.global_batch_size, args.micro_batch_size
    for step in range(args.steps):
        t0 = time.perf_counter()
        lr = lr_at(step + 1, args.lr, min_lr, args.warmup_steps, args.steps)
        batch = data.global_batch(step, G)
        labels_np = batch["labels"]
        n_lm = max(int((labels_np[:, 1:] != -100).sum()), 1)
        n_mtp = [max(int((labels_np[:, d + 1 :] != -100).sum()), 1) for d in range(1, ref.D + 1)]
        lm_total, mtp_total, kl_total = 0.0, [0.0] * ref.D, 0.0
        step_kl = dict.fromkeys(ref.indexer.layers, 0.0)
        step_recall = dict.fromkeys(ref.indexer.layers, 0.0)
        n_micro = G // M
        margins.step = {}
        for mb in micro_batches(batch, 0, 1, M):
            ids = torch.from_numpy(np.ascontiguousarray(mb["input_ids"]))
            labels = torch.from_numpy(np.ascontiguousarray(mb["labels"]))
            mask = torch.from_numpy(np.ascontiguousarray(mb["attention_mask"])) if "attention_mask" in mb else None
            with margins.mode():
                lm, mtps = ref.forward_losses(ids, labels, mask)
            terms = ref.indexer.terms()  # layer -> (KL, recall): per-micro-batch means
            # the warm-up trains on the indexer KL alone; otherwise LM + MTP (+ the sparse KL)
            obj = torch.zeros(()) if ref.indexer_stage == "warmup" else lm / n_lm
            if ref.indexer_stage != "warmup":
                for d, t in enumerate(mtps):
                    obj = obj + (ref.mtp_weight / ref.D) * t / n_mtp[d]
            if terms:  # the indexer KL: a per-micro-batch mean, over the global number of micro-batches
                kl = torch.stack([terms[i][0] for i in sorted(terms)]).sum()
                obj = obj + ref.indexer_coeff * kl / n_micro
                kl_total += float(kl.detach())
                for i, (kl_i, recall_i) in terms.items():
                    step_kl[i] += float(kl_i.detach()) / n_micro
                    step_recall[i] += recall_i / n_micro
            obj.backward()
            with torch.no_grad():
                for p, m in low:
                    if p.grad is not None:
                        m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                        p.grad = None
            lm_total += float(lm.detach())
            for d, t in enumerate(mtps):
                mtp_total[d] += float(t.detach())
        with torch.no_grad():
            gnorm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for _, p in params if p.grad is not None))
            pre_clip = {n: p.grad.clone() for n, p in params if p.grad is not None} if (step + 1) in dumps else None
            if args.clip_grad > 0 and math.isfinite(gnorm):
                coef = args.clip_grad / (gnorm + 1e-6)
                if coef < 1.0:
                    for _, p in params:
                        if p.grad is not None:
                            p.grad.mul_(coef)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in low:
                p.copy_(m.to(p.dtype))  # the bf16 weight is its master rounded
        if args.moe_bias_update_rate > 0:  # after the update: step 1 routes with the loaded biases
            ref.update_router_biases(args.moe_bias_update_rate)
        idle_experts.append(ref.take_idle_experts())
        if "indexer_losses" in hist:
            hist["indexer_losses"].append(kl_total / n_micro)
            kl_rows.append([step_kl[i] for i in ref.indexer.layers])
            recall_rows.append([step_recall[i] for i in ref.indexer.layers])
        hist["losses"].append(lm_total / n_lm)
        if ref.D:
            hist["mtp_losses"].append(sum(mtp_total[d] / n_mtp[d] for d in range(ref.D)) / ref.D)
        hist["grad_norms"].append(gnorm)
        hist["lrs"].append(lr)
        gaps.append(margins.step)
        if pre_clip is not None:
            tensors: dict[str, dict] = {k: {} for k in DUMP_KINDS}
            for n, p in params:
                st = opt.state.get(p, {})
                srcs = (pre_clip.get(n), st.get("exp_avg"), st.get("exp_avg_sq"), p.detach())
                for kind, src in zip(DUMP_KINDS, srcs):  # grads, exp_avg, exp_avg_sq, weights
                    if src is not None:
                        tensors[kind].update(ref.official(n, src))
            for n, b in ref.router_biases():  # buffers: moved by the bias updates, never by the optimizer
                tensors["weights"].update(ref.official(n, b))
            for d in dumps[step + 1]:
                write_dump(ref, d, tensors)
        mtp_txt = f" mtp {hist['mtp_losses'][-1]:.6f}" if ref.D else ""
        if ref.indexer.layers and ref.indexer_stage != "none":
            mtp_txt += f" indexer kl {hist['indexer_losses'][-1]:.5f} recall {_mean(step_recall.values()):.4f}"
        print(
            f"[reference] step {step + 1}/{args.steps} loss {hist['losses'][-1]:.6f}{mtp_txt} lr {lr:.3e} "
            f"grad norm {gnorm:.4f} {time.perf_counter() - t0:.2f} s",
            flush=True,
        )
        result = dict(
            hist,
            topk_min_gaps=gaps,
            expert_load={"idle_experts": idle_experts, "bias_update_rate": args.moe_bias_update_rate},
            indexer_loss_coeff=ref.indexer_coeff,
            **_indexer_block(ref, kl_rows, recall_rows, step + 1),
            steps=step + 1,
            seed=args.seed,
            reference=f"torch + transformers GlmMoeDsaForCausalLM (eager, {args.dtype}) + torch MTP",
            dtype=args.dtype,
            versions={m.__name__: m.__version__ for m in (torch, transformers, np)}
            | {"python": platform.python_version()},
            run={
                "data": data.describe,
                "tokens_per_step": G * args.seq_len,
                "micro_batch_size": M,
                "settings": recorded_settings(args),
            },
            checkpoint={"path": os.path.abspath(args.model)},
        )
        # strict JSON, as the trainer writes its loss.json (a margin that stayed infinite, every
        # decision an exact tie, is written as null and listed under "nonfinite")
        write_record(os.path.join(args.out, "loss.json"), result)
    return result


def _mean(values) -> float:
    v = list(values)
    return sum(v) / len(v) if v else math.nan


def _indexer_block(ref: Reference, kl: list, recall: list, steps: int) -> dict:
    """loss.json's ``indexer`` block, in the trainer's schema ([step][layer] matrices)."""
    if ref.indexer_stage == "none":
        return {}
    return {
        "indexer": {
            "stage": ref.indexer_stage,
            "loss_weight": ref.indexer_coeff,
            "shared_supervision": ref.indexer_shared,
            "layers": ref.indexer.layers,
            "steps": list(range(1, steps + 1)),
            "kl": kl,
            "recall": recall,
            "mean_recall": [_mean(r) for r in recall],
        }
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(
            f"paddleformers_glm.parity.reference.train: needs the reference extra (torch + transformers): {e}",
            file=sys.stderr,
        )
        return 2
    if why := config_error(args) or data_error(args):
        print(f"paddleformers_glm.parity.reference.train: error: {why}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    train(args)
    return 0


def config_error(args: argparse.Namespace) -> str | None:
    """Why the checkpoint's config cannot be trained as glm52 train trains it: transformers would
    apply a setting in training mode (``attention_dropout``) that glm52 train refuses, so the two
    runs would train different models; refused here in glm52 train's words, before the model loads."""
    from ...configuration import GlmMoeDsaConfig

    try:
        GlmMoeDsaConfig.from_pretrained(args.model).check_training_support()
    except (ValueError, OSError) as e:
        return str(e)
    return None


def data_error(args: argparse.Namespace) -> str | None:
    """Why ``--data`` cannot be trained on (records with no label to train on, a bad .npy, ...), as
    glm52 train refuses it: checked before the model is loaded, in one line, not a traceback."""
    if args.data is None:
        return None
    from ...train.data import data_problem

    return data_problem(args.data, args.model, args.seq_len, args.seed, args.data_dtype)


if __name__ == "__main__":
    sys.exit(main())
