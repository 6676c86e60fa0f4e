"""A stand-in of exllamav3's Python API, as crossrt's backend calls it, for tests without CUDA:
the calls are recorded with their keyword arguments, for tests/test_exllamav3_source.py to check
against 1.6.5's signatures."""

import json
import types
from pathlib import Path

import torch


class StandIn:
    """exllamav3 as crossrt calls it. A folder's config.json may carry a "stand_in" entry:
    components, caps per component, block_size. Calls land in `calls` as (name, kwargs)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        stand_in = self

        class Config:
            def __init__(self, directory):
                data = json.loads((Path(directory) / "config.json").read_text())
                extra = data.get("stand_in", {})
                self.directory, self.architecture = str(directory), data["architectures"][0]
                self.model_classes = {component: None for component in extra.get("components", ["text"])}
                self.caps = extra.get("caps", {})
                self.block_size = extra.get("block_size")
                self.vocab_size, self.eos_token_id_list = data["vocab_size"], [data["eos_token_id"]]
                self.layers, self.kv_heads, self.head_dim = (data["num_hidden_layers"], data["num_key_value_heads"],
                                                             data["head_dim"])

            @staticmethod
            def from_directory(directory, **kwargs):
                stand_in.calls.append(("Config.from_directory", kwargs))
                return Config(directory)

        class Model:
            def __init__(self, config, component):
                self.config, self.component = config, component
                self.caps = dict(config.caps.get(component, {}))
                self.modules = ([types.SimpleNamespace(key="model.embed_tokens", caps={"prefer_cpu": True})]
                                + [types.SimpleNamespace(key=f"model.layers.{i}", caps={})
                                   for i in range(config.layers)]
                                + [types.SimpleNamespace(key="model.norm", caps={}),
                                   types.SimpleNamespace(key="lm_head", caps={}, alt_key="model.embed_tokens")])
                self.caches = []

            @staticmethod
            def from_config(config, **kwargs):
                stand_in.calls.append(("Model.from_config", kwargs))
                return Model(config, kwargs.get("component", "text"))

            def load(self, **kwargs):
                stand_in.calls.append(("Model.load", kwargs))
                for cache in self.caches:
                    # What loading asserts of each attached cache (model/model_ls.py:104-115, modules/attn.py:109)
                    assert kwargs.get("max_chunk_size", 2048) <= cache.max_num_tokens, "Cache too small for batch shape"

            def warmup(self, **kwargs):
                stand_in.calls.append(("Model.warmup", kwargs))
                return []

            def prefill(self, input_ids, params):
                stand_in.calls.append(("Model.prefill", {"tokens": input_ids.shape[1], **params}))

            def forward(self, input_ids, params):
                stand_in.calls.append(("Model.forward", {"tokens": input_ids.shape[1], **params}))
                rows = 1 if params.get("last_tokens_only") else input_ids.shape[1]
                return torch.zeros((1, rows, self.config.vocab_size + 128), dtype=torch.half)  # a padded head

            def unload(self):
                stand_in.calls.append(("Model.unload", {}))

        class Cache:
            def __init__(self, model, **kwargs):
                stand_in.calls.append(("Cache", kwargs))
                self.max_num_tokens = kwargs["max_num_tokens"]
                config = model.config
                # CacheLayer_fp16.storage_size: K and V, pages x 256 x kv_heads x head_dim FP16 (cache/fp16.py:27, 92)
                size = 2 * self.max_num_tokens * config.kv_heads * config.head_dim * 2
                self.layers = {i: types.SimpleNamespace(storage_size=lambda: size) for i in range(config.layers)}
                model.caches.append(self)

        class Tokenizer:
            @staticmethod
            def from_config(config):
                return Tokenizer()

            def encode(self, text, **kwargs):
                stand_in.calls.append(("Tokenizer.encode", kwargs))
                return torch.tensor([[ord(c) % 512 for c in text]], dtype=torch.long)

        class Job:
            def __init__(self, **kwargs):
                stand_in.calls.append(("Job", kwargs))
                self.input_ids, self.draft_stats = kwargs["input_ids"], []

        class Generator:
            """Emits 3 tokens in one round (2 drafts accepted, then EOS 1)."""

            def __init__(self, model, cache, tokenizer, **kwargs):
                stand_in.calls.append(("Generator", kwargs))
                self.k, self.jobs = kwargs.get("num_draft_tokens"), []

            def enqueue(self, job):
                self.jobs.append(job)

            def num_remaining_jobs(self):
                return len(self.jobs)

            def iterate(self):
                job = self.jobs.pop()
                ids = torch.cat([job.input_ids, torch.tensor([[7, 8, 1]])], dim=1)
                job.sequences = [types.SimpleNamespace(sequence_ids=types.SimpleNamespace(torch=lambda: ids))]
                final = {"stage": "streaming", "eos": True, "eos_reason": "stop_token", "new_tokens": 3,
                         "time_prefill": 0.1, "time_generate": 0.2}
                if self.k:
                    job.draft_stats = [(3, self.k, 2)]
                    final.update(accepted_draft_tokens=2, rejected_draft_tokens=self.k - 2)
                return [final]

            def close(self):
                pass

        self.module = types.ModuleType("exllamav3")
        for cls in (Config, Model, Cache, Tokenizer, Job, Generator):
            setattr(self.module, cls.__name__, cls)
        self.module.ArgmaxSampler = lambda: "argmax"
        self.util = types.ModuleType("exllamav3.util")
        self.util.cuda_sync_active = lambda: self.calls.append(("cuda_sync_active", {}))
        self.module.util = self.util

    def kwargs(self, name: str) -> list[dict]:
        return [kwargs for called, kwargs in self.calls if called == name]
