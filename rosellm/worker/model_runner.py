"""The model runner: turns a step's inputs into tensors and runs the model on them.

It owns the model, the attention backend and the paged KV pool. It is handed each step's
`StepInputs` (plain lists: new tokens, lengths, block tables) and builds the batch's tensors; the model
itself only ever sees those tensors.
"""

import torch

from ..attention.kv_pool import KVPool
from ..attention.metadata import AttentionMetadata
from ..attention.selector import get_attention_backend
from ..model_executor.layers import packed_linear, quantized_linear
from ..model_executor.model_loader.loader import load_model
from ..utils import blocks_for
from .step_inputs import StepInputs


class ModelRunner:
    """One process's model: the whole model, or the slice of tensor-parallel rank `rank` of `size`;
    `quantization` and `dtype` as `load_model` takes them; `int8_activations`: quantized layers on fp32 compute
    run few rows on integer dot products (layers/quantized_linear.py's `use_integer_dot`)."""

    def __init__(
        self,
        model=None,
        device: str = "cpu",
        dtype: torch.dtype | str | None = None,
        attention_backend: str | None = None,
        enforce_eager: bool = False,
        rank: int = 0,
        size: int = 1,
        quantization: str | None = None,
        int8_activations: bool = True,
    ):
        self.device = torch.device(device)
        self.enforce_eager = enforce_eager
        self.attention_backend = get_attention_backend(attention_backend, self.device, enforce_eager)
        self.model, _ = load_model(model, self.device, dtype, rank, size, quantization)
        self.model.set_attention_backend(self.attention_backend)
        packed_linear.pack_linears(self.model)  # on CPU: every projection on a weight packed once for oneDNN
        if int8_activations:
            quantized_linear.use_integer_dot(self.model)
        if not enforce_eager:
            self.model.compile_step()
        self.config = self.model.config
        self.dtype = self.model.dtype  # a quantized LM head holds integer codes
        self.kv_pool: KVPool | None = None
        self.saved_blocks: tuple[list[int], torch.Tensor, torch.Tensor] | None = None  # see save_blocks
        self.max_blocks_per_seq = 0

    def bytes_per_token(self) -> int:
        return KVPool.bytes_per_token(self.config, self.dtype)

    def allocate_kv_pool(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.kv_pool = KVPool(self.config, num_blocks, block_size, self.dtype, self.device)
        self.max_blocks_per_seq = blocks_for(max_model_len, block_size)  # the width of a block table
        if not self.enforce_eager:
            self.warm_up()

    # (new tokens, full blocks cached before them) of each row of a warm-up forward: one decoding sequence,
    # a prompt, two decoding sequences (the decoding graphs attend inside themselves) and mixed batches, so
    # that the three graphs of the step (see `mark_dynamic_sizes`) and the "cpu" backend's decode kernel for
    # groups of 1 or more rows and table width 1 or more are compiled before the first request; then, for a
    # backend that attends decoding rows inside the graph up to a bound, one more batch of decoding rows past it
    WARM_UP_BATCHES = (
        ((1, 0),),
        ((1, 1),),
        ((3, 0),),
        ((1, 0), (3, 0)),
        ((1, 1), (3, 0)),
        ((1, 1), (1, 1), (3, 0)),
        ((1, 0), (1, 0)),
    )

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile now: run one forward per batch of WARM_UP_BATCHES on block 0, storing nothing (slot -1).
        Sizes that happen to be equal in one of these forwards must not be compiled as equal (duck shaping
        off)."""
        block_size = self.kv_pool.block_size
        batches = self.WARM_UP_BATCHES
        if self.attention_backend.graph_decode is not None:
            batches += (((1, 0),) * (self.attention_backend.graph_decode_rows + 1),)
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            for rows in batches:
                new_lens = [new for new, _ in rows]
                seq_lens = [cached * block_size + new for new, cached in rows]
                if blocks_for(max(seq_lens), block_size) > self.max_blocks_per_seq:
                    continue
                tables = torch.zeros((len(rows), self.max_blocks_per_seq), dtype=torch.int32)
                metadata = AttentionMetadata.build(new_lens, seq_lens, tables, block_size, self.device)
                metadata.slot_mapping.fill_(-1)
                input_ids = torch.zeros(sum(new_lens), dtype=torch.long, device=self.device)
                self.model.compute_logits(self.model(input_ids, metadata, self.kv_pool))

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Run every row's new tokens in one forward; their keys and values go into the pool.
        Returns hidden states [num_tokens, hidden], rows end to end."""
        width = max(len(table) for table in inputs.block_tables)  # the longest table of this step
        tables = [table + [-1] * (width - len(table)) for table in inputs.block_tables]
        block_tables = torch.tensor(tables, dtype=torch.int32)  # [batch, width], -1: no block
        metadata = AttentionMetadata.build(
            inputs.num_new_tokens, inputs.seq_lens, block_tables, self.kv_pool.block_size, self.device
        )
        input_ids = torch.tensor(inputs.token_ids, device=self.device)  # [num_tokens]
        return self.model(input_ids, metadata, self.kv_pool)  # the backend plans at the first attention

    @torch.inference_mode()
    def sampling_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """[num_tokens, hidden] -> logits [positions that sample, vocab_size]: the last new token of each row
        whose chunk reaches its sequence's end (a chunk in the middle of a prompt has nothing to sample),
        and before it, in order, the positions of the row's drafts (the target's verdict on each)."""
        ends = torch.tensor(inputs.num_new_tokens, device=hidden.device).cumsum(0) - 1
        if inputs.num_drafts is None:
            return self.model.compute_logits(hidden[ends[torch.tensor(inputs.samples, device=hidden.device)]])
        positions = [
            position
            for end, samples, num_drafts in zip(ends.tolist(), inputs.samples, inputs.num_drafts)
            if samples
            for position in range(end - num_drafts, end + 1)
        ]
        return self.model.compute_logits(hidden[positions])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy on write: each (source, copy) pair's keys and values, in every layer, in order."""
        for source, copy in copies:
            self.kv_pool.keys[:, copy] = self.kv_pool.keys[:, source]
            self.kv_pool.values[:, copy] = self.kv_pool.values[:, source]

    def save_blocks(self, block_ids: list[int]) -> None:
        """Keep a copy of some blocks' keys and values in every layer, for `restore_blocks`."""
        self.saved_blocks = (
            block_ids,
            self.kv_pool.keys[:, block_ids].clone(),
            self.kv_pool.values[:, block_ids].clone(),
        )

    def restore_blocks(self) -> None:
        """Put back the blocks of the last `save_blocks`."""
        block_ids, keys, values = self.saved_blocks
        self.kv_pool.keys[:, block_ids] = keys
        self.kv_pool.values[:, block_ids] = values

    def close(self) -> None:
        """Let the KV pool go (a tensor-parallel runner also stops its processes)."""
        self.kv_pool = None
