"""torchtitan's Hugging Face export of a model sharded here: its CheckpointManager, unchanged,
saving the last step in HF format through a StateDictAdapter for the tests' GPT
(integrations/test_torchtitan_pieces.py; the TP and EP exports in runtime/test_tp_compose.py
and runtime/test_ep.py)."""

from __future__ import annotations

import glob
import os

import torch.distributed as dist


def gpt_adapter():
    """The GPT's StateDictAdapter (torchtitan's protocol): HF names. torchtitan's Llama3
    adapter also permutes q/k for RoPE's layout; this model has no RoPE, so names only."""
    from torchtitan.protocols.state_dict_adapter import StateDictAdapter

    class GPTAdapter(StateDictAdapter):
        def __init__(self):
            self.fqn_to_index_mapping, self.hf_assets_path = None, None

        def to_hf(self, sd):
            return {("lm_head.weight" if k == "head.weight" else f"model.{k}"): v for k, v in sd.items()}

        def from_hf(self, hf):
            return {("head.weight" if k == "lm_head.weight" else k.removeprefix("model.")): v
                    for k, v in hf.items()}

        def get_hf_storage_reader(self, path, from_quantized=False):
            from torch.distributed.checkpoint import HuggingFaceStorageReader
            return HuggingFaceStorageReader(path)

    return GPTAdapter()


def titan_hf_export(model, folder: str, step: int) -> dict | None:
    """torchtitan's CheckpointManager, unchanged, saving the last step in HF format (DCP with
    a HuggingFaceStorageWriter over the model's sharded state dict, through the adapter's
    to_hf), on every rank of ``model``'s mesh (TP and EP included); rank 0 reads the
    safetensors back through from_hf and returns them (other ranks: None)."""
    from safetensors.torch import load_file
    from torchtitan.components.checkpoint import CheckpointManager
    ckpt = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="titan", interval=1, keep_latest_k=0,
                                 last_save_model_only=True, last_save_in_hf=True),
        dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
        sd_adapter=gpt_adapter(), base_folder=folder)
    ckpt.save(curr_step=step, last_step=True)
    ckpt.close()
    dist.barrier()
    if dist.get_rank():
        return None
    files = glob.glob(os.path.join(folder, "titan", "step-*", "*.safetensors"))
    return gpt_adapter().from_hf({k: v for f in files for k, v in load_file(f).items()})
