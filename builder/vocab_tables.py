"""The vocabulary tables of an engine graph: the table the embedding gathers rows from, the one lm_head multiplies
by, and where a tied model stores one for both (a mixin of builder/model_graph.py's _Builder, whose config,
tensors and graph it uses).

    lm_head                                      embedding (tied, tp 1: the same initializer)
    calibrated, quantize_lm_head, SHARED_TABLE   calibrated_gather of ModelOpt's table (the float embedding dropped)
    quantize_lm_head / lm_head_dtype int8        the packed table at the head's bits: QuantGather + QuantMatMul, or
                                                 GatherBlockQuantized + MatMulNBits (plugins/linear.py)
    lm_head_dtype bfloat16                       Bf16Gather + Bf16MatMul (plugins/bf16_matmul.py)
    float32, the engine's kernels running them   QuantMatMul's float32 tiles, read by QuantGather
    float32 otherwise                            Gather of the float32 table; Gemm(transB) over it when tied

At tp > 1 each rank's lm_head is its vocabulary shard, and a tied embedding a whole table of its own at the head's
precision. Under fp8 (ONNX Gather takes no float8 tensor) the float32 embedding stays next to the fp8 lm_head.
"""
from __future__ import annotations

import dataclasses

from engine.core import engine_format as ec
from engine.plugins import quant_matmul
from engine.plugins.bf16_matmul import bf16_gather, bf16_linear
from engine.plugins.calibrated_linear import calibrated_gather, calibrated_linear
from engine.plugins.gguf_tiles import gguf_gather, gguf_node
from engine.plugins.linear import linear, quantized_gather, quantized_linear
from engine.quantization.calibrated_weights import EMBEDDING_TABLE, SHARED_TABLE
from engine.quantization.weight_only import QuantizedWeight, quantize


@dataclasses.dataclass
class Head:
    """What embed() placed that lm_head() reads."""
    tied: bool                                  # tp 1 and no lm_head.weight of its own: one table for both
    shape: tuple[int, int]                      # the embedding's [V, H]
    float_tiles: bool = False                   # the table is QuantMatMul's float32 tiles
    shared_table: QuantizedWeight | None = None  # the quantized lm_head's table, placed by the embedding
    shared_calibrated: object = None            # ModelOpt's lm_head table, placed by the embedding
    gguf_table: tuple | None = None             # (initializer, gguf_tiles.Format) of a GGUF embedding's tiles


class VocabTables:
    def embed(self) -> tuple[str, Head]:
        """The embedding's rows of the step's tokens [T, H], and what it placed for lm_head."""
        m, g, p = self.m, self.g, self.p
        tied = m.tie_word_embeddings and self.tp == 1 and "lm_head.weight" not in self.t
        # tp > 1: a rank holds its vocabulary shard of lm_head and the whole embedding, which a tied model still
        # stores at the head's precision, as a table of its own (the same rows tp=1's shared table holds)
        own_table = m.tie_word_embeddings and not tied
        if self.gguf:   # a table kept as GGUF blocks: QuantGather of its tiles, which a tied lm_head reads too
            parts = self.t.gguf_parts("vocab_embedding.weight")
            if parts is not None:
                rows, f = gguf_gather(g, parts[0], ec.INPUT_IDS, name="/model/embed_tokens",
                                      weight_name="vocab_embedding.weight")
                return rows, Head(tied, parts[0].shape, gguf_table=("vocab_embedding.weight", f) if tied else None)
        embedding = self.take("vocab_embedding.weight")
        # a float32 tied lm_head as QuantMatMul's float32 tiles (plugins/linear.float_matmul), which the embedding's
        # QuantGather reads too
        float_tiles = tied and not self.head_quantized and not self.bf16_head and \
            quant_matmul.float_runs(embedding.shape[0], kernel=p.engine_kernels_plugin)
        head = Head(tied, embedding.shape, float_tiles)
        if self.calibrated and self.q.quantize_lm_head and m.tie_word_embeddings and self.q.mode in SHARED_TABLE:
            # the embedding reads the quantized lm_head's table (stored once); the float embedding is dropped. At
            # tp > 1 it reads a whole copy of that table (quantization/calibrated_weights.shard_calibrated), lm_head
            # its shard
            name = f"{EMBEDDING_TABLE}.weight" if self.tp > 1 else "lm_head.weight"
            table = self.t.pop_calibrated(name, self.q.mode, self.q.group_size)
            head.shared_calibrated = None if self.tp > 1 else table
            return calibrated_gather(g, table, ec.INPUT_IDS, name="/model/embed_tokens",
                                     weight_name=name, plugin=p.weight_only_quant_matmul_plugin,
                                     kernel=p.engine_kernels_plugin, accuracy_level=self.q.accuracy_level or 0), head
        if (tied or own_table) and self.head_quantized and self.scheme is not None:
            table = quantize(embedding, self.head_scheme, name="vocab_embedding.weight")
            head.shared_table = table if tied else None
            return quantized_gather(g, table, ec.INPUT_IDS, name="/model/embed_tokens",
                                    weight_name="vocab_embedding.weight", plugin=p.weight_only_quant_matmul_plugin,
                                    kernel=p.engine_kernels_plugin, accuracy_level=self.scheme.accuracy_level), head
        if (tied or own_table) and self.bf16_head:   # lm_head's bfloat16 table (at tp 1 stored once for both)
            return bf16_gather(g, embedding, ec.INPUT_IDS, name="/model/embed_tokens",
                               weight_name="vocab_embedding.weight"), head
        if float_tiles:   # lm_head's float32 tiles, stored once for both
            tiles = g.weight("vocab_embedding.weight", quant_matmul.pack_float(embedding))
            return quant_matmul.float_gather(g.scope("/model/embed_tokens"), tiles, ec.INPUT_IDS,
                                             embedding.shape[1]), head
        return g.node("Gather", [g.weight("vocab_embedding.weight", embedding), ec.INPUT_IDS],
                      name="/model/embed_tokens/Gather", axis=0), head

    def lm_head(self, normed: str, head: Head) -> str:
        """The logits [S, vocab] of the final norm's rows `normed`, over the table embed() chose."""
        m, g, p = self.m, self.g, self.p
        if head.gguf_table is not None:
            tiles, f = head.gguf_table
            return gguf_node(g.scope("/lm_head"), normed, tiles, head.shape[0], f, float_x=self.q.float_activations)
        if self.gguf and not head.tied:
            return self.proj(normed, "lm_head.weight", "/lm_head")
        if head.shared_table is not None:
            return quantized_linear(g, normed, head.shared_table, None, name="/lm_head",
                                    weight_name="vocab_embedding.weight", accuracy_level=self.scheme.accuracy_level,
                                    plugin=p.weight_only_quant_matmul_plugin, shared=True,
                                    kernel=p.engine_kernels_plugin)
        if head.tied and self.bf16_head:
            return bf16_linear(g, normed, None, name="/lm_head", weight_name="vocab_embedding.weight", n=m.vocab_size)
        if head.float_tiles:
            return quant_matmul.float_node(g.scope("/lm_head"), normed, "vocab_embedding.weight", *head.shape)
        if head.tied:
            # Gemm reads the embedding [V, H] transposed in place: the tied weight is stored once, not twice.
            return g.node("Gemm", [normed, "vocab_embedding.weight"], name="/lm_head/Gemm", transB=1)
        if head.shared_calibrated is not None:
            return calibrated_linear(g, normed, head.shared_calibrated, None, name="/lm_head",
                                     weight_name="lm_head.weight", plugin=p.weight_only_quant_matmul_plugin,
                                     accuracy_level=self.q.accuracy_level or 0, shared=True,
                                     kernel=p.engine_kernels_plugin)
        if self.calibrated and self.q.quantize_lm_head:
            return self.proj(normed, "lm_head.weight", "/lm_head")
        if self.bf16_head:
            table = self.take("lm_head.weight")
            return bf16_linear(g, normed, table, name="/lm_head", weight_name="lm_head.weight", n=table.shape[0])
        return linear(g, normed, self.take("lm_head.weight"), None, name="/lm_head", weight_name="lm_head.weight",
                      scheme=self.head_scheme if self.head_quantized else None,
                      plugin=p.weight_only_quant_matmul_plugin, kernel=p.engine_kernels_plugin)
