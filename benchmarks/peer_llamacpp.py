"""llama.cpp as a peer (see peer_protocol), on a GGUF (F32, or the bundled Q4_1 file as it is), through
llama-cpp-python's low-level API: its `Llama` class decodes one sequence at a time, so this script batches itself.
One sequence id per request; each `llama_decode` carries one token of every running sequence (decodes first), then
as many waiting prompts as fit in `max_num_batched_tokens`; a finished sequence leaves the KV cache at once and a
waiting one takes its id (continuous batching); the next token is the argmax of the logits (greedy). Runs in
.peers/llamacpp."""

import collections

import llama_cpp as lc
import numpy as np
from peer_protocol import Clock, serve

GGML_TYPE_F32 = 0  # an fp32 KV cache, as the other engines keep (llama.cpp's default is f16)


class Engine:
    def __init__(self, spec: dict):
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(spec["model"].encode(), lc.llama_model_default_params())
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        options, requests = spec["options"], spec["requests"]
        params = lc.llama_context_default_params()
        # one KV cache shared by all sequences (unified), large enough to hold every request at once
        params.n_ctx = -(-sum(len(p) + m for p, m in requests) // 256) * 256
        params.n_batch = params.n_ubatch = options["max_num_batched_tokens"]
        params.n_seq_max = options["max_num_seqs"]
        params.n_threads = params.n_threads_batch = spec["threads"]
        params.type_k = params.type_v = GGML_TYPE_F32
        params.kv_unified = True
        self.context = lc.llama_init_from_model(self.model, params)
        self.memory = lc.llama_get_memory(self.context)
        self.batch = lc.llama_batch_init(params.n_batch, 0, 1)
        self.max_tokens, self.max_seqs = params.n_batch, params.n_seq_max
        keys = "n_ctx n_batch n_ubatch n_seq_max n_threads n_threads_batch kv_unified flash_attn_type".split()
        self.settings = {key: getattr(params, key) for key in keys}
        self.settings |= {"kv_cache_type": "f32", "system_info": lc.llama_print_system_info().decode()}

    def put(self, n: int, token: int, position: int, seq: int, logits: bool) -> None:
        batch = self.batch
        batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, position, 1, logits
        batch.seq_id[n][0] = seq

    def generate(self, requests: list) -> dict:
        clock, waiting, free = Clock(len(requests)), collections.deque(range(len(requests))), list(range(self.max_seqs))
        running = {}  # sequence id -> [request index, tokens so far, position of the next token]
        while waiting or running:
            rows, n = [], 0
            for seq, (_, tokens, position) in running.items():
                self.put(n, tokens[-1], position, seq, True)
                rows.append((seq, n))
                n += 1
            while waiting and free and n + len(requests[waiting[0]][0]) <= self.max_tokens:
                i, seq = waiting.popleft(), free.pop()
                prompt = requests[i][0]
                for position, token in enumerate(prompt):
                    self.put(n + position, token, position, seq, position == len(prompt) - 1)
                n += len(prompt)
                running[seq] = [i, [], len(prompt) - 1]
                rows.append((seq, n - 1))
            if n == 0:
                raise RuntimeError("a prompt is longer than max_num_batched_tokens")
            self.batch.n_tokens = n
            if lc.llama_decode(self.context, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            for seq, row in rows:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.context, row), shape=(self.vocab,))
                state = running[seq]
                state[1].append(int(logits.argmax()))
                state[2] += 1
                done = len(state[1]) == requests[state[0]][1]
                clock.token(state[0], state[1] if done else None)
                if done:
                    lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
                    del running[seq]
                    free.append(seq)
        return clock.result()


def load(spec: dict):
    engine = Engine(spec)
    return engine, {"engine": "llamacpp", "version": lc.__version__, "settings": engine.settings}


if __name__ == "__main__":
    serve(load, lambda engine, requests: engine.generate(requests))
