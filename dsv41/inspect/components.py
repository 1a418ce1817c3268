"""What each kind of component is: a paragraph, its formulas (LaTeX), its shapes and its layer roles.

Every number comes from the config, so a small config gets pages about itself. Formulas follow
docs/ARCHITECTURE.md (the section is named on each kind); shapes name their dims the way the seed
documents do (docs/PARAMETERS.md §7), "[B batch, T positions, 4 streams, 5120 d]". `code` lists where the
kind lives in dsv41 as "module:qualname" references (locations.py turns them into files and line ranges).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig
from ..model.roles import LayerRole, derive_roles
from .roles import seed_groups
from .accounting import layers_text, ranges


@dataclass(frozen=True)
class Formula:
    label: str
    latex: str


@dataclass(frozen=True)
class Port:
    """A tensor crossing the component boundary ("in", "out") or a notable one inside it ("inside")."""

    role: str
    name: str
    dims: tuple[str, ...]

    def render(self) -> str:
        return f"{self.name} [{', '.join(self.dims)}]"


@dataclass(frozen=True)
class ComponentKind:
    key: str
    title: str
    description: str
    formulas: tuple[Formula, ...]
    ports: tuple[Port, ...]
    roles: tuple[str, ...]
    code: tuple[str, ...]
    spec: str
    present: bool = True
    built: bool = True
    """False where dsv41.model does not build the part (its figures come from the checkpoint layout)."""


def _tex(template: str, **values) -> str:
    """Fill @name placeholders (LaTeX is full of braces, so str.format does not fit)."""
    for name in sorted(values, key=len, reverse=True):
        template = template.replace("@" + name, str(values[name]))
    return template


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _power_of_ten(x: float) -> str:
    exponent = round(math.log10(x))
    return f"10^{{{exponent}}}" if 10.0**exponent == x else str(x)


class _Context:
    """The config's numbers and role lists, named once for all the kinds below."""

    def __init__(self, cfg: ModelConfig, roles: tuple[LayerRole, ...]):
        self.cfg, self.roles = cfg, roles
        backbone = [r for r in roles if not r.is_dspark]
        self.backbone = backbone
        self.by_ratio = {k: [r.layer_id for r in backbone if r.kind == k] for k in ("window", "pooled", "token")}
        self.kv_sources = [r for r in backbone if r.is_kv_source]
        self.index_sources = [r for r in backbone if r.is_index_source]
        self.candidate_users = [r.layer_id for r in backbone if r.candidate_source is not None]
        self.engram_layers = list(cfg.engram_layer_ids)
        c = cfg
        self.B, self.T = "B batch", "T positions"
        self.S, self.D = f"{c.hc_mult} streams", f"{c.dim} d"
        self.H, self.Dh = f"{c.n_heads} heads", f"{c.head_dim} head dim"
        self.latent = f"{c.head_dim} latent"
        self.C = "C compressed positions"
        self.V = f"{c.vocab_size} vocab"

    def ratio_lines(self) -> tuple[str, ...]:
        names = {"window": "window only (r = 0)", "pooled": "pooled (r > 1)", "token": "token (r = 1)"}
        return tuple(f"{names[k]}: {layers_text(v)}" for k, v in self.by_ratio.items() if v)

    def stream(self, name: str, role: str = "in") -> Port:
        return Port(role, name, (self.B, self.T, self.S, self.D))


# -------------------------------------------------------------------------------------- the kinds
def _model(x: _Context) -> ComponentKind:
    c = x.cfg
    parts = [f"{c.n_layers} backbone blocks (layers 0–{c.n_layers - 1})"]
    if c.dspark_enabled:
        parts.append(f"{c.n_mtp_layers} DSpark stages (mtp.0–{c.n_mtp_layers - 1}, layer ids "
                     f"{c.n_layers}–{c.n_all_layers - 1})")
    if c.vision_enabled:
        parts.append(f"a {c.vision_n_layers}-block ViT and the aligner")
    return ComponentKind(
        "model", "DeepSeek-V4.1 model",
        f"The whole network. Token ids are embedded and copied into {c.hc_mult} hyper-connection streams; "
        f"Engram adds an n-gram memory read to the streams entering blocks {ranges(x.engram_layers) or '(none)'}; "
        f"{c.n_layers} blocks read and rewrite the streams; the last block's FFN reading mix collapses them into "
        "one vector per position, which the final norm and the head turn into fp32 logits. Around this text "
        "path sit the image path (a ViT and an aligner whose rows replace the embeddings of image-span "
        "positions) and the DSpark draft stages, which read the mean streams entering layers "
        f"{ranges(c.dspark_target_layer_ids) or '(none)'}.",
        (Formula("streams", _tex(r"X^{(0)}_{k} = \operatorname{embed}(\mathrm{ids}),\quad k = 1, \ldots, @S",
                                 S=c.hc_mult)),
         Formula("stack", _tex(r"(X^{(\ell+1)}, \mathrm{pre}^{(\ell+1)}) = \operatorname{Block}_{\ell}\big("
                               r"\operatorname{Engram}_{\ell}(X^{(\ell)}), \mathrm{pre}^{(\ell)}\big),\quad "
                               r"\ell = 0, \ldots, @L", L=c.n_layers - 1)),
         Formula("logits", _tex(r"\mathrm{logits} = \operatorname{head}\Big(\operatorname{RMSNorm}\big("
                                r"\sum_{i} \mathrm{pre}^{(@L)}_i X^{(@L)}_i\big)\Big)", L=c.n_layers))),
        (Port("in", "ids", (x.B, x.T)), Port("out", "logits", (x.B, x.V)),
         Port("out", "DSpark hidden", (x.B, x.T, f"{len(c.dspark_target_layer_ids) * c.dim} "
                                                 f"({len(c.dspark_target_layer_ids)} targets × {c.dim} d)"))),
        tuple(parts), ("dsv41.model.transformer:Transformer",), "docs/ARCHITECTURE.md §4")


def _stack(x: _Context) -> ComponentKind:
    c = x.cfg
    pooled_src = [r.layer_id for r in x.kv_sources if r.ratio > 1]
    token_src = [r.layer_id for r in x.kv_sources if r.ratio == 1]
    reindex = [r.layer_id for r in x.index_sources if not r.is_kv_source]
    text = (f"The {c.n_layers} backbone blocks and the {len(x.engram_layers)} Engram modules between them, "
            "taken as one component. A source layer compresses the whole sequence so far into one "
            f"{c.head_dim}-feature vector per {max((r.ratio for r in x.kv_sources), default=0)} tokens "
            f"({layers_text(pooled_src)}) or per token ({layers_text(token_src)}), and "
            f"chooses {c.index_topk} of them for every query; the layers after it borrow both until the next "
            "source.")
    if reindex:
        text += (f" From layer {reindex[0]} on, layers {', '.join(map(str, reindex))} choose again with their own "
                 f"queries, against layer {c.candidate_source_layer}'s keys and inside layer "
                 f"{c.candidate_source_layer}'s {c.candidate_topk_blocks:,} candidate blocks; the keys and values "
                 f"stay layer {c.candidate_source_layer}'s.")
    rows = tuple(f"{g.name}: " + (f"before block {g.engram_layer}" if g.engram_layer is not None
                                  else layers_text(g.layers)) for g in seed_groups(x.roles))
    hashes = f"{len(x.engram_layers)} Engram layers, {c.engram_hash_columns} n-grams × heads"
    return ComponentKind(
        "stack", f"{c.n_layers} layers", text,
        (Formula("stack", _tex(r"(X, \mathrm{pre}) \leftarrow \operatorname{Block}_{\ell}\big("
                               r"\operatorname{Engram}_{\ell}(X), \mathrm{pre}\big),\quad \ell = 0, \ldots, @L",
                               L=c.n_layers - 1)),),
        (x.stream("X"), Port("in", "pre", (x.B, x.T, x.S)), Port("in", "hash ids", (x.B, x.T, hashes)),
         x.stream("X", "out"), Port("out", "pre", (x.B, x.T, x.S))),
        rows, ("dsv41.model.transformer:Transformer.forward", "dsv41.model.roles:derive_roles", "dsv41.inspect.roles:seed_groups"),
        "docs/ARCHITECTURE.md §3–§5, docs/PARAMETERS.md §5")


def _block(x: _Context) -> ComponentKind:
    return ComponentKind(
        "block", "Block",
        "One backbone layer: attention, then the MoE. Each sublayer reads the streams through a weighted sum, "
        "normalises it, computes, and writes back through the hyper-connections: every new stream is a "
        "post weight times the output plus a Sinkhorn-balanced mix of the old streams. The reading weights lag "
        "one sublayer: attention reads with the mix the previous block's FFN computed (stream 0 for layer 0), "
        "the FFN with the mix computed before attention.",
        (Formula("attention input", r"a = \operatorname{RMSNorm}_{\mathrm{attn}}\Big(\sum_i \mathrm{pre}^{\mathrm{in}}_i X_i\Big)"),
         Formula("attention write", r"X'_j = \mathrm{post}^{a}_j \operatorname{Attn}(a) + \sum_i c^{a}_{ij} X_i"),
         Formula("FFN input", r"f = \operatorname{RMSNorm}_{\mathrm{ffn}}\Big(\sum_i \mathrm{pre}^{a}_i X'_i\Big)"),
         Formula("FFN write", r"X''_j = \mathrm{post}^{f}_j \operatorname{MoE}(f) + \sum_i c^{f}_{ij} X'_i")),
        (x.stream("X"), Port("in", "pre_in", (x.B, x.T, x.S)), x.stream("X''", "out"),
         Port("out", "pre_f", (x.B, x.T, x.S))),
        x.ratio_lines(), ("dsv41.model.block:Block",), "docs/ARCHITECTURE.md §5")


def _attention(x: _Context) -> ComponentKind:
    c = x.cfg
    return ComponentKind(
        "attention", "Attention",
        f"Multi-head latent attention with one shared key = value latent of {c.head_dim} features. The query "
        f"goes through a rank-{c.q_lora_rank} latent to {c.n_heads} heads of {c.head_dim}; the key/value is one "
        f"{c.head_dim}-vector per position, rotated on its last {c.rope_head_dim} features and fp8 "
        f"quantise-dequantised. Every layer attends to the last {c.window_size} positions; layers with a "
        f"compress ratio also attend to up to {c.index_topk} compressed positions picked by their index source. "
        f"The output removes the query's rotation, maps each of {c.o_groups} head groups to {c.o_lora_rank} "
        f"features and projects the {c.o_groups * c.o_lora_rank} back to {c.dim}.",
        (Formula("query", r"q = \operatorname{RoPE}_p\big(W_{qb}\,\operatorname{RMSNorm}(W_{qa}\,x)\big)"),
         Formula("key = value", r"kv = \operatorname{QDQ}_{\mathrm{fp8}}\big(\operatorname{RoPE}_p("
                                r"\operatorname{RMSNorm}(W_{kv}\,x))\big)"),
         Formula("output", _tex(r"o = W_{ob}\,\big[W^{(g)}_{oa}\,\operatorname{RoPE}^{-1}_p(\mathrm{out})^{(g)}"
                                r"\big]_{g=1}^{@G}", G=c.o_groups)),
         Formula("rotary frequencies", _tex(r"\omega_i = \theta^{-2i/@R},\quad \theta = @a \text{ (r = 0) or } "
                                            r"@b \text{ with YaRN (r > 0)}", R=c.rope_head_dim,
                                            a=_num(c.rope_theta), b=_num(c.compress_rope_theta)))),
        (Port("in", "x", (x.B, x.T, x.D)), Port("out", "o", (x.B, x.T, x.D)),
         Port("inside", "q", (x.B, x.T, x.H, x.Dh)), Port("inside", "kv", (x.B, x.T, x.latent)),
         Port("inside", "grouped output", (x.B, x.T, f"{c.o_groups} groups", f"{c.o_lora_rank} rank"))),
        x.ratio_lines(), ("dsv41.model.attention:Attention", "dsv41.model.rope:Rotary"),
        "docs/ARCHITECTURE.md §10, §11")


def _compressor(x: _Context) -> ComponentKind:
    c = x.cfg
    pooled = [r.layer_id for r in x.kv_sources if r.ratio > 1]
    token = [r.layer_id for r in x.kv_sources if r.ratio == 1]
    lines = []
    if pooled:
        lines.append(f"softmax pooling (wkv, wgate, norm): {layers_text(pooled)}")
    if token:
        lines.append(f"projection (wkv, norm): {layers_text(token)}")
    return ComponentKind(
        "compressor", "Compressor",
        "Turns the normalised input of a KV-source layer into compressed positions. With a ratio r > 1 it "
        "pools each group of r tokens channel by channel, with a softmax over learned gate scores (wkv and "
        "wgate run in fp32); with r = 1 it is one projection per token. The latent is normalised, the index "
        "keys are derived from it before RoPE, then it is rotated at the group's first position, fp4 "
        "quantise-dequantised and stored in the source's compressed cache, which the following layers of "
        "the same ratio read.",
        (Formula("pooling", r"\mathrm{pooled}_{j,c} = \sum_{t \in \{jr, \ldots, jr+r-1\}} "
                            r"\operatorname{softmax}_t(g_{t,c})\, a_{t,c},\quad a = W_{kv}\,x,\; g = W_{\mathrm{gate}}\,x"),
         Formula("latent", r"\mathrm{latent}_j = \operatorname{RMSNorm}(\mathrm{pooled}_j)\quad (r > 1),\qquad "
                           r"\mathrm{latent}_p = \operatorname{RMSNorm}(W_{kv}\,x_p)\quad (r = 1)"),
         Formula("stored row", r"\mathrm{row}_j = \operatorname{QDQ}_{\mathrm{fp4}}\big(\operatorname{RoPE}_{jr}("
                               r"\mathrm{latent}_j)\big)"),
         Formula("visibility", r"j < \lfloor (p+1)/r \rfloor")),
        (Port("in", "x", (x.B, x.T, x.D)), Port("out", "latent", (x.B, "T/r groups", x.latent)),
         Port("inside", "tail state", (x.B, "r slots", x.latent))),
        tuple(lines), ("dsv41.model.compressor:Compressor",), "docs/ARCHITECTURE.md §11.3–§11.5",
        present=bool(x.kv_sources))


def _indexer(x: _Context) -> ComponentKind:
    c = x.cfg
    owners = [r.layer_id for r in x.index_sources if r.is_kv_source]
    borrowers = [r for r in x.index_sources if not r.is_kv_source]
    lines = [f"owns its index keys (wk, k_norm): {layers_text(owners)}"]
    lines += [f"layer {r.layer_id}: scores against layer {r.kv_source}'s keys" for r in borrowers]
    lines.append("the other compressed layers reuse the selection of the latest index source")
    return ComponentKind(
        "indexer", "Indexer",
        f"Chooses which compressed positions each query's attention reads. Its {c.index_n_heads} heads of "
        f"{c.index_head_dim} features score every visible compressed position with a ReLU dot product against "
        "the source's index keys, weighted per head by a projection of the input; the best "
        f"{c.index_topk} positions, sorted by position, become the compressed part of the attention's index "
        "list. KV sources turn their latent into index keys; later index sources score against their KV "
        "source's keys.",
        (Formula("index keys", r"k_j = \operatorname{QDQ}_{\mathrm{fp4}}\big(\operatorname{RoPE}_{jr}("
                               r"\operatorname{RMSNorm}(W_k\,\mathrm{latent}_j))\big)"),
         Formula("index query and head weights", _tex(
             r"q^{I}_{t} = \operatorname{QDQ}_{\mathrm{fp4}}\big(\operatorname{RoPE}_t(W^{I}_{qb}\,q^{r}_t)\big),"
             r"\quad w^{I}_t = \frac{W_{\mathrm{proj}}\,x_t}{\sqrt{@Di \cdot @Hi}}", Di=c.index_head_dim,
             Hi=c.index_n_heads)),
         Formula("score", _tex(r"I_{t,j} = \sum_{h=1}^{@Hi} \operatorname{relu}(q^{I}_{t,h} \cdot k_j)\, w^{I}_{t,h}",
                               Hi=c.index_n_heads)),
         Formula("selection", _tex(r"\mathrm{idx}_t = \operatorname{sort}\big(\operatorname{topk}_{\min(@K, C)}"
                                   r"(I_{t,j})\big),\quad j < \lfloor (t+1)/r \rfloor", K=c.index_topk))),
        (Port("in", "q latent", (x.B, x.T, f"{c.q_lora_rank} q rank")), Port("in", "x", (x.B, x.T, x.D)),
         Port("in", "index keys", (x.B, x.C, f"{c.index_head_dim} index dim")),
         Port("out", "indices", (x.B, x.T, f"{c.index_topk} top-k")),
         Port("inside", "scores", (x.B, x.T, x.C))),
        tuple(lines), ("dsv41.model.indexer:Indexer", "dsv41.model.indexer:select_topk", "dsv41.model.indexer:visible_counts"),
        "docs/ARCHITECTURE.md §11.6", present=bool(x.index_sources))


def _candidate(x: _Context) -> ComponentKind:
    c = x.cfg
    bs, nb = c.candidate_block_size, c.candidate_topk_blocks
    return ComponentKind(
        "candidate", "Candidate stage",
        f"A coarse pre-selection made at the candidate source (layer {c.candidate_source_layer}): its "
        f"compressed positions are grouped into blocks of {bs}, a block scores the best of its positions, the "
        "block holding the query's newest visible position is always kept (it may be only partly filled), "
        f"and the best {nb:,} blocks survive. The later index sources choose their top-{c.index_topk} inside "
        "those blocks only. The stage has no parameters of its own; it reuses the indexer's scores.",
        (Formula("block score", _tex(r"S_{t,b} = \max_{j \in [@Bs b,\, @Bs b + @Bs)} I_{t,j}", Bs=bs)),
         Formula("pinned block", _tex(r"S_{t,b^{*}} = +\infty,\quad b^{*} = \lfloor (\mathrm{vis}_t - 1) / @Bs \rfloor",
                                      Bs=bs)),
         Formula("kept blocks", _tex(r"\mathrm{keep}_t = \operatorname{topk}_{\min(@Nb,\, n_{\mathrm{blocks}})}"
                                     r"(S_{t,b})", Nb=nb))),
        (Port("in", "scores", (x.B, x.T, x.C)), Port("out", "kept positions", (x.B, x.T, x.C)),
         Port("inside", "block scores", (x.B, x.T, f"⌈C/{bs}⌉ blocks"))),
        (f"source: layer {c.candidate_source_layer}",
         f"restricted to its blocks: {layers_text(x.candidate_users)}"),
        ("dsv41.model.indexer:candidate_blocks",), "docs/ARCHITECTURE.md §11.6",
        present=c.candidate_source_layer is not None)


def _sparse_attention(x: _Context) -> ComponentKind:
    c = x.cfg
    both = c.window_size + c.index_topk
    window = layers_text(x.by_ratio["window"]) + (f"; DSpark stages mtp.0–{c.n_mtp_layers - 1}" if c.dspark_enabled else "")
    compressed = x.by_ratio["pooled"] + x.by_ratio["token"]
    return ComponentKind(
        "sparse_attention", "Sparse attention with sink",
        "The attention kernel: per query and head, a softmax over an explicit list of key rows — up to "
        f"{c.window_size} window rows and up to {c.index_topk} compressed rows — where key and value are the "
        f"same {c.head_dim}-feature latent. A learned per-head sink logit joins the denominator only, so a head "
        "can give weight to nothing; it is not scaled and adds no value. A query with no valid row returns "
        "zeros.",
        (Formula("logits", _tex(r"z_t = \frac{q_h \cdot \mathrm{KV}_t}{\sqrt{@Dh}},\quad m = \max(-10^{30}, \max_t z_t)",
                                Dh=c.head_dim)),
         Formula("output", r"\mathrm{out}_h = \frac{\sum_t e^{z_t - m}\, \mathrm{KV}_t}{\sum_t e^{z_t - m} + "
                           r"e^{\mathrm{sink}_h - m}}")),
        (Port("in", "q", (x.B, x.T, x.H, x.Dh)), Port("in", "key rows", (x.B, "N rows", x.latent)),
         Port("in", "indices", (x.B, x.T, f"≤ {both} ({c.window_size} window + {c.index_topk} compressed)")),
         Port("out", "out", (x.B, x.T, x.H, x.Dh))),
        (f"window rows only (≤ {c.window_size}): {window}",
         f"window + compressed rows (≤ {both}): {layers_text(compressed)}"),
        ("dsv41.model.attention:sparse_attention", "dsv41.model.attention:window_indices"),
        "docs/ARCHITECTURE.md §11.7")


def _moe_lines(x: _Context) -> tuple[str, ...]:
    c = x.cfg
    lines = [f"backbone layers 0–{c.n_layers - 1}: {c.n_routed_experts} routed experts, top {c.n_activated_experts}, "
             f"{c.n_shared_experts} shared"]
    if c.dspark_enabled:
        lines.append(f"DSpark stages: {c.dspark_n_routed_experts or c.n_routed_experts} routed experts, top "
                     f"{c.dspark_n_activated_experts}, 1 shared")
    return tuple(lines)


def _moe(x: _Context) -> ComponentKind:
    c = x.cfg
    return ComponentKind(
        "moe", "MoE",
        f"Mixture of experts: the router picks {c.n_activated_experts} of {c.n_routed_experts} routed experts per "
        "token and weights them; the chosen experts' outputs are summed in fp32 and the shared expert, which "
        "every token goes through, is added.",
        (Formula("output", r"y = \sum_{e \in \mathrm{chosen}} \mathrm{expert}_e(x; w_e) + \mathrm{shared}(x)"),),
        (Port("in", "x", (x.B, x.T, x.D)), Port("out", "y", (x.B, x.T, x.D))),
        _moe_lines(x), ("dsv41.model.moe:MoE",), "docs/ARCHITECTURE.md §13")


def _router(x: _Context) -> ComponentKind:
    c = x.cfg
    tokens = "n tokens"
    return ComponentKind(
        "router", "Router",
        "Scores every expert with the square root of the softplus of a dot product. Selection adds a learned "
        "per-expert bias — bias_vl instead of bias at positions inside image spans — but the weights come from "
        f"the raw scores of the chosen experts, normalised and multiplied by {_num(c.route_scale)}.",
        (Formula("score", r"s_e = \sqrt{\operatorname{softplus}(x \cdot W_e)}"),
         Formula("selection", _tex(r"\mathrm{chosen} = \operatorname{topk}_{@A}(s + b),\quad b = \mathrm{bias} "
                                   r"\text{ or } \mathrm{bias\_vl} \text{ (image spans)}", A=c.n_activated_experts)),
         Formula("weights", _tex(r"w_e = @rs \cdot \frac{s_e}{\sum_{e' \in \mathrm{chosen}} s_{e'} + 10^{-20}}",
                                 rs=_num(c.route_scale)))),
        (Port("in", "x", (tokens, x.D)), Port("out", "weights", (tokens, f"{c.n_activated_experts} active")),
         Port("out", "expert ids", (tokens, f"{c.n_activated_experts} active")),
         Port("inside", "scores", (tokens, f"{c.n_routed_experts} experts"))),
        _moe_lines(x), ("dsv41.model.moe:Router", "dsv41.model.moe:route"), "docs/ARCHITECTURE.md §13")


def _expert(x: _Context) -> ComponentKind:
    c = x.cfg
    lim = _num(c.swiglu_limit)
    tokens = "n tokens"
    return ComponentKind(
        "expert", "Expert (routed and shared)",
        f"A SwiGLU feed-forward of hidden width {c.moe_inter_dim}: gate w1 and up w3, the up branch clamped to "
        f"±{lim} and the gate only from above at {lim}, multiplied, then projected down by w2. Routed experts "
        "are stored as packed fp4 with one ue8m0 scale per 32 inputs and their routing weight multiplies the "
        "hidden activation before w2; the shared expert is the same function in fp8 without a routing weight.",
        (Formula("hidden", _tex(r"h = \operatorname{silu}\big(\min(W_1 x, @lim)\big) \odot "
                                r"\operatorname{clamp}(W_3 x, -@lim, @lim) \cdot w_e", lim=lim)),
         Formula("output", r"\mathrm{expert}_e(x; w_e) = W_2\, h")),
        (Port("in", "x", (tokens, x.D)), Port("out", "y", (tokens, x.D)),
         Port("inside", "h", (tokens, f"{c.moe_inter_dim} hidden"))),
        _moe_lines(x), ("dsv41.model.moe:RoutedExperts", "dsv41.model.moe:Expert", "dsv41.model.moe:swiglu"),
        "docs/ARCHITECTURE.md §13")


def _hyper(x: _Context) -> ComponentKind:
    c = x.cfg
    s, mix = c.hc_mult, c.hc_mix_width
    return ComponentKind(
        "hyper_connections", "Hyper-connections and Sinkhorn",
        f"The residual stream is {s} parallel copies. Before each sublayer one learned projection of all "
        f"{s * c.dim} features (one RMS statistic, no norm weight) gives {mix} mix values: {s} reading weights "
        f"(pre), {s} writing weights (post) and a {s}×{s} matrix made doubly stochastic by {c.hc_sinkhorn_iters} "
        "Sinkhorn iterations (ending on a column normalisation). The sublayer reads the pre-weighted sum of the "
        "streams; new stream j is post_j times the sublayer output plus column j of the matrix applied to the "
        "old streams.",
        (Formula("mixes", _tex(r"m = \frac{\operatorname{flatten}(X)\,\phi^{\top}}{\sqrt{\operatorname{mean}("
                               r"\operatorname{flatten}(X)^2) + \epsilon}} \in \text{@mix values}", mix=mix)),
         Formula("read and write weights", _tex(r"\mathrm{pre}_i = \sigma(m_i\, s_0 + b_i) + 10^{-6},\quad "
                                                r"\mathrm{post}_i = 2\,\sigma(m_{@S+i}\, s_1 + b_{@S+i})", S=s)),
         Formula("stream mix", _tex(r"c = \operatorname{Sinkhorn}_{@it}\big(m_{@a:@b}\, s_2 + b_{@a:@b}\big)",
                                    it=c.hc_sinkhorn_iters, a=2 * s, b=mix)),
         Formula("read and write", r"\operatorname{hc\_pre}(X) = \sum_i \mathrm{pre}_i X_i,\qquad "
                                   r"\operatorname{hc\_post}(o, X)_j = \mathrm{post}_j\, o + \sum_i c_{ij} X_i")),
        (x.stream("X"), Port("out", "pre", (x.B, x.T, x.S)), Port("out", "post", (x.B, x.T, x.S)),
         Port("out", "comb", (x.B, x.T, x.S, x.S)), Port("inside", "m", (x.B, x.T, f"{mix} mixes"))),
        ("every block and DSpark stage: hc_attn_* before attention, hc_ffn_* before the MoE",),
        ("dsv41.model.hyper:mixes", "dsv41.model.hyper:split_mixes", "dsv41.model.hyper:sinkhorn", "dsv41.model.hyper:collapse",
         "dsv41.model.hyper:expand"), "docs/ARCHITECTURE.md §7")


def _engram(x: _Context) -> ComponentKind:
    c = x.cfg
    n, de = c.engram_hash_columns, c.engram_head_dim
    rows = ", ".join(f"{r:,}" for r in c.engram_num_embeddings)
    return ComponentKind(
        "engram", "Engram",
        f"An n-gram memory read added to the streams entering blocks {ranges(x.engram_layers)}. At each position "
        f"{n} hashed n-gram ids (n-grams of 2 to {c.engram_max_ngram_size} tokens, {c.engram_n_heads} hash heads "
        f"each) fetch {n} rows of {de} fp8 features from the layer's table; wkv projects the {n * de} features "
        f"to one key per stream and one value shared by the streams; the gate of each stream scales the value "
        "before it is added to that stream. Image positions get nothing.",
        (Formula("lookup", _tex(r"E = \big[\operatorname{table}(\mathrm{id}_1), \ldots, "
                                r"\operatorname{table}(\mathrm{id}_{@N})\big]", N=n)),
         Formula("keys and value", _tex(r"[\mathrm{key}_1, \ldots, \mathrm{key}_{@S}, \mathrm{value}] = W_{kv}\,E",
                                        S=c.hc_mult)),
         Formula("write", r"X'_k = X_k + g^{e}_k\, \mathrm{value}")),
        (x.stream("X"), Port("in", "hash ids", (x.B, x.T, f"{n} n-grams × heads")), x.stream("X'", "out"),
         Port("inside", "E", (x.B, x.T, f"{n} n-grams × heads", f"{de} row")),
         Port("inside", "value", (x.B, x.T, x.D))),
        (f"before blocks {ranges(x.engram_layers)}; table rows {rows}",),
        ("dsv41.model.engram.module:Engram", "dsv41.model.engram.table:EngramTable", "dsv41.model.engram.hashing:NgramHasher"),
        "docs/ARCHITECTURE.md §9, docs/ENGRAM-HASHING.md", present=bool(x.engram_layers))


def _engram_gate(x: _Context) -> ComponentKind:
    c = x.cfg
    return ComponentKind(
        "engram_gate", "Gate per stream",
        "How well each stream matches its key, as a number between 0 and 1. The weight w is the product of two "
        f"learned {c.hc_mult} × {c.dim:,} tensors, q_weight and k_weight; each stream is normalised on its own "
        "over the model width, not jointly with the others. At an image position the gate is zero.",
        (Formula("match", _tex(r"a_{k}=\frac{\sum_{f}X_{k,f}\,w_{k,f}\,k^{e}_{k,f}}{\operatorname{rms}(X_{k})\,"
                               r"\operatorname{rms}(k^{e}_{k})\,\sqrt{@D}}", D=c.dim)),
         Formula("gate", r"g^{e}_{k}=\sigma\big(\operatorname{sign}(a_{k})\sqrt{\max(\lvert a_{k}\rvert,\,10^{-6})}\big)"),
         Formula("weight", r"w = q_{\mathrm{weight}} \odot k_{\mathrm{weight}}")),
        (x.stream("X_n"), x.stream("k^e"), Port("out", "g^e", (x.B, x.T, x.S))),
        (f"one per Engram layer: before blocks {ranges(x.engram_layers)}",),
        ("dsv41.model.engram.module:stream_gate", "dsv41.model.engram.module:Engram.forward"),
        "docs/ARCHITECTURE.md §9 steps 3–6",
        present=bool(x.engram_layers))


def _dspark(x: _Context) -> ComponentKind:
    c = x.cfg
    k = len(c.dspark_target_layer_ids)
    experts = c.dspark_n_routed_experts or c.n_routed_experts
    return ComponentKind(
        "dspark_stage", "DSpark stage",
        f"A draft stage for speculative decoding. Each of the {c.n_mtp_layers} stages is a block with window-only "
        f"attention and a {experts}-expert MoE (top {c.dspark_n_activated_experts}); the first also projects the "
        f"mean streams entering layers {ranges(c.dspark_target_layer_ids)} ({k * c.dim} features) to a {c.dim}-wide "
        "input that seeds its window; the last adds a norm, the tied head, a rank-"
        f"{c.dspark_markov_rank} Markov head that biases each draft row's logits by the previous draft token, and "
        f"a confidence head. A call drafts {max(c.dspark_block_size - 1, 0)} tokens after the sampled one.",
        (Formula("main input", _tex(r"\mathrm{main} = \operatorname{RMSNorm}\big(W_{\mathrm{main}}\,h\big),\quad "
                                    r"h = [\operatorname{mean}_k X^{(@a)}_k; \ldots; \operatorname{mean}_k X^{(@b)}_k]",
                                    a=min(c.dspark_target_layer_ids, default=0),
                                    b=max(c.dspark_target_layer_ids, default=0))),
         Formula("Markov head", r"\ell_i \leftarrow \ell_i + M_{\mathrm{head}}\, M_{\mathrm{embed}}[\mathrm{id}_i],"
                                r"\quad \mathrm{id}_{i+1} = \operatorname{sample}(\ell_i)"),
         Formula("confidence", r"c_i = W_{\mathrm{conf}}\,[z_i; M_{\mathrm{embed}}[\mathrm{id}_i]]")),
        (Port("in", "tok", (x.B,)), Port("in", "hidden", (x.B, x.T, f"{k * c.dim} ({k} targets × {c.dim} d)")),
         Port("out", "ids", (x.B, f"{c.dspark_block_size + 1} (1 + {c.dspark_block_size} drafts)")),
         Port("out", "logits", (x.B, f"{c.dspark_block_size} draft rows", x.V)),
         Port("out", "confidence", (x.B, f"{c.dspark_block_size} draft rows")),
         Port("inside", "draft rows", (x.B, f"{c.dspark_block_size} draft rows", x.S, x.D))),
        (f"stages mtp.0–{c.n_mtp_layers - 1} (layer ids {c.n_layers}–{c.n_all_layers - 1}); targets: the streams "
         f"entering layers {ranges(c.dspark_target_layer_ids)}",),
        ("dsv41.model.dspark:DSparkStage", "dsv41.model.dspark:DSparkAttention.forward", "dsv41.model.dspark:draft"),
        "docs/ARCHITECTURE.md §15, docs/GENERATION-AND-DSPARK.md",
        present=c.dspark_enabled)


def _vision(x: _Context) -> ComponentKind:
    c = x.cfg
    p, vd = c.vision_patch_size, c.vision_dim
    head = vd // max(c.vision_n_heads, 1)
    return ComponentKind(
        "vision", "Vision encoder (ViT)",
        f"The image encoder: a linear embedding of {p}×{p}-pixel RGB patches ({3 * p * p} values), "
        f"{c.vision_n_layers} pre-norm blocks of width {vd} with {c.vision_n_heads} heads of {head}, 2D rotary "
        f"positions and bidirectional attention over the image's patches, a SwiGLU MLP of {c.vision_inter_dim}, "
        "and a final RMSNorm (eps 1e-6).",
        (Formula("block", r"x \leftarrow x + \operatorname{Attn}(\operatorname{RMSNorm}_1(x)),\qquad x \leftarrow "
                          r"x + W_2\big(\operatorname{silu}(g) \odot u\big),\; [g, u] = W_1\,\operatorname{RMSNorm}_2(x)"),
         Formula("2D rotary frequencies", _tex(r"\omega_i = @th^{-2i/@h},\quad i = 0, \ldots, @m",
                                               th=_num(c.vision_rope_theta), h=head // 2, m=head // 4 - 1))),
        (Port("in", "patches", ("P patches", f"{3 * p * p} (3 × {p} × {p})")),
         Port("out", "features", ("P patches", f"{vd} vision d"))),
        (f"{c.vision_n_layers} blocks, applied once per image in the first chunk",),
        ("dsv41.checkpoint.inventory:_vision",), "docs/ARCHITECTURE.md §16.2–§16.3",
        present=c.vision_enabled, built=False)


def _aligner(x: _Context) -> ComponentKind:
    c = x.cfg
    r = c.vision_downsample_ratio
    return ComponentKind(
        "aligner", "Aligner",
        f"Pools {r}×{r} neighbouring ViT patches into one LLM position ({r * r * c.vision_dim} features, zero "
        f"padding at the bottom and right edges) and maps them with a two-layer GELU MLP to the model width "
        f"{c.dim}. Its rows replace the IMAGE positions of the image span; the span's start, end and line-break "
        "positions take the learned marker vectors.",
        (Formula("projection", _tex(r"y = W_2\,\operatorname{GELU}\big(W_1\,\operatorname{unfold}_{@r \times @r}(v)"
                                    r" + b_1\big) + b_2", r=r)),),
        (Port("in", "ViT features", ("h patch rows", "w patch columns", f"{c.vision_dim} vision d")),
         Port("out", "image rows", (f"⌈h/{r}⌉·⌈w/{r}⌉ image positions", x.D))),
        (f"one per image span, up to {c.vision_max_n_token} LLM positions",),
        ("dsv41.checkpoint.inventory:_aligner",), "docs/ARCHITECTURE.md §16.4–§16.5",
        present=c.vision_enabled, built=False)


def _head(x: _Context) -> ComponentKind:
    c = x.cfg
    return ComponentKind(
        "head", "Head",
        "After the last block the streams are collapsed with the last FFN reading mix, normalised by the "
        f"final RMSNorm and projected to the {c.vocab_size:,}-token vocabulary in fp32 (by default only at the "
        "last position). The DSpark stages share this head.",
        (Formula("logits", r"\mathrm{logits} = \operatorname{RMSNorm}\Big(\sum_i \mathrm{pre}_i X_i\Big)\, "
                           r"W_{\mathrm{head}}^{\top}"),),
        (Port("in", "y", (x.B, x.T, x.D)), Port("out", "logits", (x.B, x.V))),
        (f"after layer {c.n_layers - 1}; tied to the DSpark stages",),
        ("dsv41.model.layers:Head", "dsv41.model.transformer:Transformer.logits"), "docs/ARCHITECTURE.md §8")


def _embedding(x: _Context) -> ComponentKind:
    c = x.cfg
    return ComponentKind(
        "embedding", "Embedding",
        f"A {c.vocab_size:,} × {c.dim:,} bf16 lookup table, copied into the {c.hc_mult} streams. In a vision build "
        "three more learned vectors, image_start, image_end and image_newline, take the place of the embeddings "
        "of an image span's delimiter positions.",
        (Formula("lookup", _tex(r"e_t = E_{\mathrm{id}_t},\quad X_{t,k} = e_t\;\; (k = 1, \ldots, @S)", S=c.hc_mult)),),
        (Port("in", "ids", (x.B, x.T)), Port("out", "e", (x.B, x.T, x.D))),
        ("before layer 0; tied to the DSpark stages",),
        ("dsv41.model.layers:Embedding", "dsv41.checkpoint.inventory:_image_markers"),
        "docs/ARCHITECTURE.md §8, §16.5")


def _norm(x: _Context) -> ComponentKind:
    c = x.cfg
    return ComponentKind(
        "norm", "RMSNorm",
        "RMS normalisation with a learned scale; statistics and scaling in fp32, result rounded back to bf16. "
        f"The text model uses eps = {c.norm_eps:g} (in effect none), the ViT 1e-6. The tree counts the block "
        "norms (attn_norm, ffn_norm) and the final norm here; q_norm, kv_norm, the compressor and indexer "
        "norms, DSpark's main_norm and draft norm and the ViT norms are counted with their components.",
        (Formula("norm", _tex(r"\operatorname{RMSNorm}(x) = \frac{w \odot x}{\sqrt{\operatorname{mean}(x^2) + "
                              r"\epsilon}},\quad \epsilon = @eps", eps=_power_of_ten(c.norm_eps))),),
        (Port("in", "x", ("…", "n features")), Port("out", "y", ("…", "n features"))),
        ("attn_norm and ffn_norm in every block; the final norm before the head",),
        ("dsv41.model.layers:RMSNorm",), "docs/ARCHITECTURE.md §6.7, §8")


_BUILDERS = (_model, _stack, _block, _attention, _compressor, _indexer, _candidate, _sparse_attention, _moe,
             _router, _expert, _hyper, _engram, _engram_gate, _dspark, _vision, _aligner, _head, _embedding, _norm)


def describe_components(cfg: ModelConfig, roles: tuple[LayerRole, ...] | None = None) -> dict[str, ComponentKind]:
    x = _Context(cfg, roles if roles is not None else derive_roles(cfg))
    kinds = [build(x) for build in _BUILDERS]
    return {k.key: k for k in kinds}
