"""Hugging Face folders (config.json + safetensors): reading them, and writing them back exactly or afresh.

Used by scripts/convert_checkpoint.py, for any model family: its names, tensor layouts and
config.json come from the family's HFAdapter (its TrainSpec's `hf_adapter`), which the caller
passes in. A checkpoint made from an HF folder keeps a sidecar (the `hf` subfolder): the folder's
other files verbatim, each safetensors file's raw header and any derived buffers. With it,
unchanged weights come back as byte-identical files, whatever wrote the originals; without it (or
when the weights no longer fit it), a fresh layout is written. safetensors is an optional
dependency (the `convert` extra), imported only when needed.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from torchtitan.checkpoint.folders import CheckpointError
from torchtitan.models import get_train_spec, registered_names

if TYPE_CHECKING:
    from torchtitan.models.hf_adapter import HFAdapter

SIDECAR = "hf"  # subfolder of a checkpoint made by hf-to-dcp: what reproduces the original files
SIDECAR_FORMAT = "torchtitan-hf-sidecar-1"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.model"  # where an export puts a tokenizer file given to it (Meta's and HF's name)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
# Derived buffers some HF exports carry: kept in the sidecar, so the files still come back exactly.
_BUFFER_SUFFIX = ".rotary_emb.inv_freq"
# Names every HF `*ForCausalLM` decoder gives its embedding, final norm and output projection. A tied
# output projection is stored only as the embedding.
HF_EMBEDDING, HF_NORM, HF_OUTPUT = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def import_safetensors() -> Any:
    """The safetensors module (with safetensors.torch), or a one-line error saying how to install it."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise CheckpointError("the safetensors package is not installed; run `pip install safetensors` "
                              "(or install torchtitan with the `convert` extra)") from None
    return safetensors


def read_json(path: str, what: str) -> Any:
    """The parsed JSON file at `path`; `what` names it in the error when it is missing or invalid."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{what} not found: {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON ({e})") from None


def family_of(config: Any, prefer: str | None = None) -> tuple[str, Any] | None:
    """The registered model family whose HFAdapter reads `config` (a parsed config.json) as the model
    its `architectures` names, and the args it reads; None when none does. `prefer` is asked first
    (Llama 2 and Llama 3 read the same folders)."""
    wanted = (config.get("architectures") or [None])[0] if isinstance(config, dict) else None
    names = registered_names()
    for name in ([prefer] if prefer in names else []) + [n for n in names if n != prefer]:
        adapter = get_train_spec(name).hf_adapter
        if adapter is None:
            continue
        try:
            args = adapter.model_args_from_hf_config(config)
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
        if adapter.hf_architecture(args) == wanted:
            return name, args
    return None


def family_refusal(config: Any) -> str:
    """Why no registered family reads `config` (family_of gave None), as the converter says it: the
    refusal of the family whose models are of the architecture config.json names, e.g. `config.json:
    rope_parameters rope_type 'yarn' is not supported`; else that no family has that architecture."""
    wanted = (config.get("architectures") or [None])[0] if isinstance(config, dict) else None
    for name in registered_names():
        spec = get_train_spec(name)
        adapter = spec.hf_adapter
        if adapter is None or wanted not in {adapter.hf_architecture(args) for args in spec.config.values()}:
            continue
        try:
            adapter.model_args_from_hf_config(config)
        except (CheckpointError, KeyError, TypeError, ValueError) as e:
            return f"config.json: {e}"
    return f"no registered model reads its config.json (architectures {wanted})"


# ---------------------------------------------------------------------------------------------
# Reading


def safetensors_files(hf_dir: str) -> list[str]:
    """The weight files of an HF folder: those its index names, else the single model.safetensors."""
    index_path = os.path.join(hf_dir, INDEX)
    if os.path.exists(index_path):
        index = read_json(index_path, INDEX)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(f"{index_path} has no weight_map")
        files = sorted(set(index["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{hf_dir} has neither model.safetensors nor {INDEX}")
    for name in files:
        if os.path.basename(name) != name or not os.path.isfile(os.path.join(hf_dir, name)):
            raise CheckpointError(f"{hf_dir}: the weight file {name} named by {INDEX} is missing")
    return files


def _read_header(path: str) -> bytes:
    """The raw JSON header of a safetensors file, exactly as stored (padding included)."""
    with open(path, "rb") as f:
        size_bytes = f.read(8)
        size = struct.unpack("<Q", size_bytes)[0] if len(size_bytes) == 8 else -1
        if size < 2 or size > os.path.getsize(path) - 8:
            raise CheckpointError(f"{path} is not a safetensors file (bad header size)")
        return f.read(size)


def read_hf_tensors(hf_dir: str, files: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """HF name -> tensor over all weight files, and each file's raw header."""
    safetensors = import_safetensors()
    tensors: dict[str, torch.Tensor] = {}
    headers: dict[str, bytes] = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        headers[name] = _read_header(path)
        try:
            with safetensors.safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if key in tensors:
                        raise CheckpointError(f"{hf_dir}: tensor {key} is stored twice")
                    tensors[key] = f.get_tensor(key)
        except safetensors.SafetensorError as e:
            raise CheckpointError(f"{path} is not a valid safetensors file ({e})") from None
    return tensors, headers


def names_by_fqn(names: Iterable[str], args: Any, adapter: HFAdapter, hf_dir: str) -> dict[str, list[str]]:
    """Our FQN -> the HF tensor names it is made from (one, or an expert's part each, or a fused
    tensor it shares with another of ours), leaving out derived buffers; refuses, naming the first,
    tensors that are no parameter of the family."""
    parts: dict[str, list[str]] = {}
    unknown = []
    for name in names:
        if name.endswith(_BUFFER_SUFFIX):
            continue
        try:
            fqns = our_names(adapter, name, args)
        except KeyError:
            unknown.append(name)
            continue
        for fqn in fqns:
            parts.setdefault(fqn, []).append(name)
    if unknown:
        raise CheckpointError(f"{hf_dir} holds tensors that are not {adapter.hf_architecture(args)} parameters: "
                              f"{sorted(unknown)[0]}" + (f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""))
    return parts


def our_names(adapter: HFAdapter, name: str, args: Any) -> tuple[str, ...]:
    """`adapter.from_hf_names(name)`, given `args` too where the adapter's names depend on them
    (`from_hf_names_takes_args`: DeepSeek-V3's MTP layers follow its last block)."""
    if getattr(adapter, "from_hf_names_takes_args", False):
        return adapter.from_hf_names(name, args)  # type: ignore[call-arg]
    return adapter.from_hf_names(name)


def promised_but_missing(adapter: HFAdapter, args: Any, fqns: Iterable[str]) -> str | None:
    """Why a folder whose tensors are our `fqns` lacks what its config.json (`args`) promises, with the
    fix, where the family knows a usual cause (the adapter's optional `promised_but_missing`)."""
    explain = getattr(adapter, "promised_but_missing", None)
    return explain(args, list(fqns)) if explain is not None else None


def hf_to_ours(hf_tensors: dict[str, torch.Tensor], args: Any, adapter: HFAdapter,
               hf_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Our FQN -> tensor in our layout, and the derived buffers set aside for the sidecar. Each of
    our tensors is made from every HF tensor the adapter relates to it; those HF lacks come from
    the adapter."""
    buffers = {k: v for k, v in hf_tensors.items() if k.endswith(_BUFFER_SUFFIX)}
    parts = {fqn: {name: hf_tensors[name] for name in names}
             for fqn, names in names_by_fqn(hf_tensors, args, adapter, hf_dir).items()}
    if (why := promised_but_missing(adapter, args, parts)) is not None:
        raise CheckpointError(f"{hf_dir}: {why}")
    try:
        ours = {fqn: adapter.from_hf_tensors(fqn, group, args).contiguous() for fqn, group in parts.items()}
    except CheckpointError as e:  # the adapter names the tensor; the folder is said here
        raise CheckpointError(f"{hf_dir}: {e}") from None
    ours.update(adapter.tensors_without_hf(args))
    (output,), (embedding,) = adapter.from_hf_names(HF_OUTPUT), adapter.from_hf_names(HF_EMBEDDING)
    if adapter.ties_embeddings(args) and output not in ours and embedding in ours:
        ours[output] = ours[embedding]  # our model keeps the tied weight under both names
    return ours, buffers


# ---------------------------------------------------------------------------------------------
# The sidecar


def sidecar_writer(hf_dir: str, files: list[str], headers: dict[str, bytes],
                   buffers: dict[str, torch.Tensor]) -> Callable[[str], None]:
    """A function that stores, in a checkpoint folder, what dcp-to-hf needs to rebuild the HF
    folder byte for byte: other top-level files verbatim (config.json, the index, tokenizer
    files...), each safetensors file's header, and any derived buffers."""
    copied = sorted(n for n in os.listdir(hf_dir)
                    if os.path.isfile(os.path.join(hf_dir, n)) and not n.endswith(_WEIGHT_SUFFIXES))

    def write(ckpt: str) -> None:
        root = os.path.join(ckpt, SIDECAR)
        os.makedirs(os.path.join(root, "files"))
        os.makedirs(os.path.join(root, "headers"))
        for name in copied:
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(root, "files", name))
        for name, header in headers.items():
            with open(os.path.join(root, "headers", name + ".header"), "wb") as f:
                f.write(header)
        if buffers:
            import_safetensors().torch.save_file(buffers, os.path.join(root, "buffers.safetensors"))
        layout = {"format": SIDECAR_FORMAT, "safetensors": files, "copied": copied, "buffers": sorted(buffers)}
        with open(os.path.join(root, "layout.json"), "w") as f:
            json.dump(layout, f, indent=1)
        give_default_modes(root)

    return write


def read_layout(sidecar: str) -> dict[str, Any]:
    """The sidecar's layout.json: which files it kept, and how."""
    layout = read_json(os.path.join(sidecar, "layout.json"), "sidecar")
    if not isinstance(layout, dict) or layout.get("format") != SIDECAR_FORMAT:
        raise CheckpointError(f"{sidecar}/layout.json is not a {SIDECAR_FORMAT} layout; export with --fresh-layout "
                              "or remove the damaged sidecar folder")
    return layout


def read_original_config(sidecar: str) -> dict[str, Any]:
    """The config.json of the HF folder the sidecar was made from."""
    config = read_json(os.path.join(sidecar, "files", "config.json"), "the original config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{sidecar}/files/config.json is not a JSON object")
    return config


def _exact_plan(hf: dict[str, torch.Tensor], sidecar: str, layout: dict[str, Any], tied: bool) -> dict[str, list] | str:
    """For each original safetensors file, its tensors in data order when the checkpoint's tensors
    still fit the stored headers exactly (names, dtypes, shapes); otherwise why not."""
    if layout.get("buffers"):
        buffers_path = os.path.join(sidecar, "buffers.safetensors")
        hf = {**hf, **import_safetensors().torch.load_file(buffers_path)}
    plan, used = {}, set()
    for name in layout["safetensors"]:
        with open(os.path.join(sidecar, "headers", name + ".header"), "rb") as f:
            header = json.loads(f.read())
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
        end = 0
        for key, entry in entries:
            tensor = hf.get(key)
            start, stop = entry["data_offsets"]
            if tensor is None and (split := _split_experts(key, hf)) is not None:
                return (f"they hold the experts fused ({key}: transformers' own layout), and this export writes them "
                        f"one tensor per expert ({split}, ...), as published models are")
            if tensor is None and entry["dtype"] in ("U8", "F8_E4M3", "F8_E5M2"):
                return (f"the original files hold quantized weights ({key}, {entry['dtype']}), and exports are "
                        "unquantized")
            if tensor is None:
                return f"{key} has no tensor of that name in this export"
            if getattr(torch, _ST_DTYPES.get(entry["dtype"], "?"), None) != tensor.dtype:
                return f"{key} is {entry['dtype']} there and {str(tensor.dtype).removeprefix('torch.')} here"
            if list(tensor.shape) != entry["shape"] or start != end or stop - start != tensor.numel() * tensor.element_size():
                return f"{key} no longer fits its original place"
            end = stop
        plan[name] = [hf[k] for k, _ in entries]
        used.update(k for k, _ in entries)
    left = set(hf) - used - ({HF_OUTPUT} if tied else set())
    return plan if not left else f"{sorted(left)[0]} has no place in the original files"


def _split_experts(fused: str, hf: dict[str, torch.Tensor]) -> str | None:
    """The first per-expert tensor of `hf` where the original files hold `fused`, one tensor of every
    expert (`...mlp.experts.gate_up_proj` beside `...mlp.experts.0.gate_proj.weight`); None otherwise."""
    prefix = fused.rpartition(".")[0] + ".0."
    return next((name for name in sorted(hf) if name.startswith(prefix)), None)


def try_exact_plan(hf: dict[str, torch.Tensor], sidecar: str, layout: dict[str, Any], tied: bool) -> dict[str, list] | str:
    """`_exact_plan`, with a sidecar that cannot be read as one more reason for a fresh layout."""
    try:
        return _exact_plan(hf, sidecar, layout, tied)
    except (OSError, AttributeError, KeyError, TypeError, ValueError) as e:  # a damaged or foreign sidecar: not worth failing for
        return f"the kept original layout cannot be read ({type(e).__name__}: {e})"


# ---------------------------------------------------------------------------------------------
# Writing


def _hf_order(name: str) -> tuple:
    """Embedding, blocks in order, final norm, output: the order HF's own exports use. Within a
    block, numbers compare as numbers, so expert 10 follows expert 9 (and one expert's tensors stay
    together in a shard)."""
    if name.startswith("model.layers."):
        parts = name.split(".")
        return (1, int(parts[2]), [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts[3:]])
    return ({HF_EMBEDDING: 0, HF_NORM: 2}.get(name, 3), 0, name)


def hf_tensors_of(adapter: HFAdapter, fqn: str, w: torch.Tensor, args: Any,
                  pending: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole HF tensors that our tensor `fqn` completes: `adapter.to_hf_tensors`, except that a
    part of an HF tensor made of several of ours (gpt-oss's fused gate_up_proj, w1's and w3's
    columns: `from_hf_names` gives them all) waits in `pending` until the last part arrives, and is
    then joined by the adapter's `to_hf_fused`."""
    out = {}
    for name, tensor in adapter.to_hf_tensors(fqn, w, args).items():
        owners = our_names(adapter, name, args)
        if len(owners) < 2:
            out[name] = tensor
            continue
        parts = pending.setdefault(name, {})
        parts[fqn] = tensor
        if len(parts) == len(owners):
            out[name] = adapter.to_hf_fused(name, pending.pop(name), args)  # type: ignore[attr-defined]
    return out


def check_nothing_pending(pending: dict[str, dict[str, torch.Tensor]], adapter: HFAdapter, args: Any) -> None:
    """Refuses an export that gave only some of the parts of an HF tensor made of several of ours."""
    if pending:
        name, parts = next(iter(pending.items()))
        lacking = sorted(set(our_names(adapter, name, args)) - set(parts))
        raise CheckpointError(f"{name} is made of {', '.join(our_names(adapter, name, args))}, but the weights lack "
                              f"{lacking[0]}")


def to_hf(model: dict[str, torch.Tensor], args: Any, adapter: HFAdapter) -> dict[str, torch.Tensor]:
    """HF name -> tensor in HF's layout and order, from our FQN -> tensor. One of ours may become
    several HF tensors (views of it: `write_fresh` copies them apart), none (`to_hf_name` None), or
    part of one (`hf_tensors_of`)."""
    out, pending = {}, {}
    for k, v in model.items():
        out.update({name: t.contiguous() for name, t in hf_tensors_of(adapter, k, v, args, pending).items()})
    check_nothing_pending(pending, adapter, args)
    return dict(sorted(out.items(), key=lambda kv: _hf_order(kv[0])))


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's data as stored in safetensors (little-endian, row-major)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data


def copy_kept_files(out_tmp: str, sidecar: str, layout: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
    """The original folder's other files (tokenizer files, generation_config.json, ...) into
    `out_tmp`, except those named in `skip`."""
    for name in layout["copied"]:
        if name not in skip:
            shutil.copyfile(os.path.join(sidecar, "files", name), os.path.join(out_tmp, name))


def write_exact(out_tmp: str, sidecar: str, layout: dict[str, Any], plan: dict[str, list]) -> None:
    """The original files into `out_tmp`: the kept ones copied, the safetensors ones rebuilt from
    their kept headers and the tensors of `plan` (from `try_exact_plan`)."""
    copy_kept_files(out_tmp, sidecar, layout)
    for name, tensors in plan.items():
        with open(os.path.join(sidecar, "headers", name + ".header"), "rb") as f:
            header = f.read()
        with open(os.path.join(out_tmp, name), "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for tensor in tensors:
                f.write(_raw_bytes(tensor))


def write_fresh(out_tmp: str, hf: dict[str, torch.Tensor], config: dict[str, Any], max_shard_bytes: int) -> None:
    """config.json plus one model.safetensors, or shards and an index when over the shard size."""
    save_file = import_safetensors().torch.save_file
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(_apart(shard), os.path.join(out_tmp, name), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in hf.values())
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        with open(os.path.join(out_tmp, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(out_tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def _apart(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`shard` with tensors that share storage (the per-expert views of one stacked tensor) copied
    apart: safetensors refuses to save shared storage. One shard at a time, so the copies cost at
    most a shard's size."""
    seen: set[int] = set()
    out = {}
    for name, tensor in shard.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out


def give_default_modes(folder: str) -> None:
    """Gives `folder` and everything in it the modes of a file the user creates (0666 / 0777 less the
    umask, so 0644 / 0755 usually). safetensors writes its files 0600, which made exports unreadable
    to the other users of a shared model folder."""
    umask = os.umask(0)  # reading the umask means setting it; restored at once (the converter is single-threaded)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)
