"""Byte-level decoder-only Transformer LM on the Python standard library's source files.

The default trains on 8 emulated CPU devices (data=2 x stage=4) in a few minutes on a 2-core
machine, and the eval loss falls clearly. Sized-up variants are for TPU VMs.

Commands::

  # Default (size=small): 8 emulated CPU devices, data=2 x stage=4.
  python -m tpipe.train --config=configs/lm.py --workdir=/tmp/lm

  # The same LM written in Flax NNX.
  python -m tpipe.train --config=configs/lm.py --workdir=/tmp/lm_nnx --config.frontend=nnx

  # A tiny smoke run.
  python -m tpipe.train --config=configs/lm.py:size=tiny --workdir=/tmp/t --config.num_steps=50

  # Another mesh layout or schedule; any field can be overridden with --config.key=value.
  python -m tpipe.train --config=configs/lm.py --workdir=/tmp/lm2 \\
      --config.num_stages=2 --config.num_data=4 --config.schedule=circular --config.num_repeats=2

  # Pipeline x FSDP x tensor parallelism: 2 stages, each over 2 fsdp x 2 tensor devices.
  python -m tpipe.train --config=configs/lm.py --workdir=/tmp/lm3d \\
      --config.num_stages=2 --config.num_data=1 --config.mesh.fsdp=2 --config.mesh.tensor=2

  # On a TPU VM (v4-8: 4 chips): a bigger model, stages over the chips, bfloat16 compute.
  python -m tpipe.train --config=configs/lm.py:size=base --workdir=$HOME/lm \\
      --config.num_stages=4 --config.num_data=1 --config.dtype=bfloat16

Sizes: ``tiny`` (tests), ``small`` (default, CPU), ``base`` and ``large`` (TPU).
"""

import ml_collections

# name -> (num_layers, width, num_heads, mlp_dim, seq_len, batch_size, num_microbatches,
#          num_steps, learning_rate)
_SIZES = {
    "tiny": (4, 32, 2, 64, 32, 16, 8, 20, 3e-3),
    "small": (8, 64, 2, 256, 64, 32, 4, 300, 3e-3),
    "base": (24, 1024, 16, 4096, 1024, 256, 32, 20_000, 3e-4),
    "large": (48, 2048, 16, 8192, 2048, 512, 64, 50_000, 2e-4),
}


def _parse_arg(arg):
  """Parses ``"size=small,key=value"`` into a dict; a bare word is taken as the size."""
  out = {}
  for part in filter(None, (arg or "").split(",")):
    if "=" in part:
      key, value = part.split("=", 1)
      out[key.strip()] = value.strip()
    else:
      out["size"] = part.strip()
  return out


def get_config(arg=None):
  """Returns the LM experiment config.

  Args:
    arg: the text after ``:`` in ``--config=configs/lm.py:ARG``, e.g. ``size=tiny``.

  Returns:
    An ``ml_collections.ConfigDict``.
  """
  args = _parse_arg(arg)
  size = args.pop("size", "small")
  if args:
    raise ValueError(f"Unknown config argument(s) {sorted(args)}; only size=... is accepted.")
  if size not in _SIZES:
    raise ValueError(f"Unknown size {size!r}; choose one of {sorted(_SIZES)}.")
  (num_layers, width, num_heads, mlp_dim, seq_len, batch_size, num_microbatches, num_steps,
   learning_rate) = _SIZES[size]

  config = ml_collections.ConfigDict()
  config.size = size  # The size preset the defaults come from (tiny, small, base, large).

  config.num_layers = num_layers  # Transformer blocks.
  config.width = width  # Model width (the residual stream).
  config.num_heads = num_heads  # Attention heads per block.
  config.mlp_dim = mlp_dim  # Hidden width of each block's MLP.
  config.seq_len = seq_len  # Tokens per training sequence.
  # Dropout rate in the embedding and the gpt blocks (short runs: none).
  config.dropout = 0.0 if size in ("tiny", "small") else 0.1
  # Computation dtype, "float32" or "bfloat16" (mixed precision: parameters and optimizer state
  # stay float32; logits and the loss are float32).
  config.dtype = "float32"

  # Pipeline and mesh: num_stages * num_data * mesh.fsdp * mesh.expert * mesh.tensor devices.
  config.num_stages = 4
  config.num_data = 2
  # Inside each stage: weights and optimizer state split over mesh.fsdp devices (ZeRO-3, with
  # each micro-batch's rows), the MLP's, embedding's and head's matrices over mesh.tensor devices,
  # a mixture's experts (block="moe") over mesh.expert devices (as the layers' logical axis
  # names say: tpipe.axis_rules.DEFAULT_RULES).
  config.mesh = ml_collections.ConfigDict({"fsdp": 1, "expert": 1, "tensor": 1})
  # Over several slices (multislice TPU): how many slices the stage, data and fsdp axes span
  # (product = slices). emulate_slices cuts this machine's devices into that many to try it.
  config.mesh.dcn = ml_collections.ConfigDict({"stage": 1, "data": 1, "fsdp": 1})
  config.mesh.emulate_slices = False
  # Read what crosses a link one tick late, so the send overlaps a tick of compute: "auto"
  # (the links between slices), "0", "1" or one 0/1 per link of the stage ring ("0,1,0,1").
  config.transfer_delay = "auto"
  # Where the batch arrives split over the stages (M a multiple of S): each micro-batch's inputs
  # reach stage 0 one per tick from the stage that holds them, not gathered before the step.
  config.stream_inputs = True
  # Fused schedules lay their table out in compound ticks (a forward, a backward and weight work
  # per tick, so ticks cost the same on every stage): "" for per-action costs derived from the
  # layers' measured FLOPs, "F=1,B=3,BI=2,W=1" to give them, "plain" for one action per tick.
  config.tick_costs = ""
  # Experimental, with tick_costs given: sweeps of exact window search over the compound table
  # (tpipe.experimental.refine: a shorter step where the builder's rules miss one; seconds to
  # minutes at S = 8, once per run; 4 sweeps is what the experiments use); 0 for none.
  config.tick_search = 0
  # "zb_h1", "zbv": what W computes again so that a micro-batch awaiting it holds less. "none";
  # "forward": the chunk's forward, for its operations' inputs (it holds their output
  # gradients; one more chunk forward per micro-batch); "backward": the chunk's forward and
  # backward (it holds the chunk's output gradient; about one more fused backward).
  config.weight_recompute = "none"
  # Fused schedules in compound ticks: run a stage's forward of one micro-batch and backward
  # of another in one conditional, layer loops unrolled, so the compiler can hide one's
  # collectives (the experts' all-to-all) behind the other's compute. Longer compiles.
  config.overlap_microbatches = False

  config.num_microbatches = num_microbatches  # Micro-batches per step (of each data shard).
  # The pipeline schedule: "gpipe", "circular" (num_repeats > 1), or a fused one: "1f1b",
  # "interleaved_1f1b", "zb_h1", "zbv" (num_repeats=2).
  config.schedule = "gpipe"
  config.num_repeats = 1  # Model chunks per stage (circular, interleaved and zbv schedules).
  # What the backward recomputes: "none", "full" (a chunk's forward), or a policy name.
  config.remat = "none" if size in ("tiny", "small") else "full"
  # What remat checkpoints: "nested" (a stage's whole chunk, and inside it each block: a
  # micro-batch in flight keeps one input per chunk and the backward holds one block's
  # intermediates, for one more forward per block), "chunk" (the chunk alone: its backward holds
  # every block's intermediates), "layer" (each block: each micro-batch in flight keeps one
  # input per block), or an int k (every k blocks).
  config.remat_granularity = "nested"
  # How the layers (embedding, blocks, head with the loss) are cut into stages: "flops"
  # (forward+backward FLOPs per layer), "params", "time" (measured; for real accelerators, noisy
  # on CPU), or unit counts per chunk such as "3,2,2,3" (the embedding and the head count one unit
  # each, every block one).
  config.balance = "flops"
  # Token ids of the model: 0 takes the tokenizer's vocabulary size (256 for bytes).
  config.vocab_size = 0
  # The block: "gpt" (LayerNorm, multi-head attention, GELU MLP, dropout), "llama" (RMSNorm,
  # grouped-query attention with num_kv_heads key/value heads, SwiGLU MLP; every matrix named
  # for fsdp and tensor parallelism) or "moe" (llama's with a mixture of experts, below).
  # num_kv_heads = None means num_heads.
  config.block = "gpt"
  config.num_kv_heads = ml_collections.FieldReference(None, field_type=int)
  # Positions: "learned" (a table of max_len rows in the embedding) or "rotary" (rotary
  # embeddings in llama blocks, base rope_theta; rope_scaling is Hugging Face's rope_scaling
  # as JSON, "" for none).
  config.positions = "learned"
  config.rope_theta = 10000.0
  config.rope_scaling = ""
  # Rows of the learned position table (0: seq_len); longer sequences than this are refused.
  config.max_len = 0
  # Each attention head's width (0: width // num_heads; llama blocks only).
  config.head_dim = 0
  # Epsilon of every norm; the head's norm, "layer" (LayerNorm) or "rms" (RMSNorm).
  config.norm_epsilon = 1e-6
  config.final_norm = "layer"
  # Whether the vocabulary projection has a bias; whether the query/key/value projections of
  # llama blocks have biases (Qwen2); how many keys a llama block's query attends (0: all).
  config.head_bias = True
  config.qkv_bias = False
  config.sliding_window = 0
  # How the blocks attend (tpipe.train.flash_attention): "blocked" (XLA, any platform) or
  # "flash" (a fused kernel, by the devices' platform: Pallas splash attention on TPU, seq_len a
  # multiple of 128; cuDNN's on GPU, dtype bfloat16; no dropout; refused on CPU); "splash",
  # "cudnn" name one kernel, "splash_interpret" runs splash attention by the Pallas interpreter
  # on any platform (slow: tests). Same parameters either way: a run may resume with another.
  config.attention = "blocked"
  # block="moe" (Mixtral's): the llama block whose MLP is a mixture of num_experts SwiGLU
  # experts (mlp_dim wide each), each token to experts_per_token of them; capacity_factor 0
  # routes dropless (no token dropped), else each expert takes at most capacity_factor x its
  # even share. The router's load-balancing loss and z-loss join the training loss with these
  # weights. The experts split over mesh.expert devices.
  config.num_experts = 8
  config.experts_per_token = 2
  config.capacity_factor = 0.0
  config.router_aux_loss_coef = 0.01
  config.router_z_loss_coef = 0.001
  # How block="moe"'s tokens reach experts split over mesh.expert devices: "partitioner" (XLA's
  # partitioner gathers the tokens to every expert device and sums the outputs) or "all_to_all"
  # (an explicit all-to-all of each device's pairs there and of the outputs back; dropless
  # only). The same parameters either way: a run may resume with the other.
  config.moe_dispatch = "partitioner"
  # With moe_dispatch="all_to_all": each device's tokens exchanged in this many parts, each
  # through its own all-to-alls and experts, so that one part's all-to-all can run while the
  # experts compute another's (the same bytes and FLOPs); it must divide the tokens each expert
  # device routes. 1: one exchange.
  config.moe_exchange_chunks = 1
  # How block="moe" mixes a token's experts: by their router probabilities renormalised to sum
  # to one (True, Mixtral) or as they are (False, Qwen2-MoE).
  config.normalize_expert_weights = True
  # The hidden width of block="moe"'s shared expert (Qwen2-MoE's), a SwiGLU MLP every token goes
  # through, its output scaled by a sigmoid gate of the token; 0: none.
  config.shared_expert_mlp_dim = 0
  # One matrix for the embedding and the head (two exact copies, their gradients summed:
  # tpipe.train.tied); needs head_bias=False.
  config.tie_embeddings = False
  # The Hugging Face family the architecture comes from ("llama", "mistral", "mixtral",
  # "qwen2", "qwen2_moe", "gpt2"; set by init_from), which export writes; "" for tpipe's own.
  config.family = ""
  # The loss a vocabulary slice at a time (a divisor of vocab_size): the head never forms a
  # micro-batch's whole [batch, seq, vocab] logits. 0: as many slices as keep each slice's
  # logits on a device at most 64 MiB, none while they are under 512 MiB; 1: all at once.
  config.vocab_chunks = 0
  # How the model is written: "linen" (tpipe.train.models) or "nnx" (tpipe.train.models_nnx,
  # the same LM in Flax NNX; same parameter names, so the same checkpoints).
  config.frontend = "linen"

  config.seed = 0  # Seeds the initialisation, the data order and dropout.
  config.batch_size = batch_size  # Global batch, sharded over 'data'.
  config.num_steps = num_steps  # Training steps.
  config.learning_rate = learning_rate  # Peak learning rate (AdamW).
  # Linear warm-up steps, then cosine decay to a tenth of the peak at num_steps.
  config.warmup_steps = max(1, min(100, num_steps // 10))
  config.weight_decay = 0.1  # AdamW's decoupled weight decay (kernels and embeddings).
  config.grad_clip = 1.0  # Clip the gradients' global norm to this.
  # Adam's moments of the embedding and the head (one staged leaf, real on two stages) kept at
  # their real entries only, split over the stages: "auto" (yes, unless the stage axis spans
  # slices, where the update's all-to-alls of their gradients would cross DCN every step),
  # "on", "off".
  config.compact_moments = "auto"

  # Start from a pretrained model: a Hugging Face checkpoint directory (config.json and
  # *.safetensors of a Llama, Mistral, Mixtral, Qwen2 or GPT-2 model) or another run's workdir. Its
  # architecture replaces the model fields above; "" trains from scratch.
  config.init_from = ""

  # Data: "stdlib" (the Python standard library's source as bytes), or a path or glob of
  # files (several separated by commas), tokenized, documents packed into seq_len tokens.
  config.data = "stdlib"
  # The files' format: "" (from each suffix), "text" (a document per file), "jsonl", "parquet"
  # or "arrayrecord" (python -m tpipe.train.cli.write_corpus writes one).
  config.data_format = ""
  # The JSONL field or Parquet column holding each document's text.
  config.text_field = "text"
  # Held-out files for evaluation (path or glob); "" holds out eval_fraction of the documents.
  config.eval_data = ""
  # "bytes", a Hugging Face tokenizer.json, or a SentencePiece .model (local paths).
  config.tokenizer = "bytes"
  # The token that ends each document ("" for the tokenizer's end-of-sequence token).
  config.eod_token = ""
  config.max_corpus_bytes = 4_000_000  # Cap on stdlib bytes read; keeps start-up fast.
  config.eval_fraction = 0.1  # Share of files (stdlib) or documents held out for eval.
  config.eval_batches = 4  # Evaluation batches (a fixed set).

  config.log_every = 10 if num_steps >= 100 else 1  # Log a line every this many steps.
  config.eval_every = 50 if num_steps >= 100 else 10  # Evaluate every this many steps.
  config.checkpoint_every = 100 if num_steps >= 100 else 10  # Save every this many steps.
  config.keep_checkpoints = 3  # How many recent checkpoints to keep.
  # Trace these steps ("FIRST,LAST", e.g. "10,15") with the JAX profiler into workdir/profile
  # (XProf: tensorboard --logdir=workdir/profile); "" for none.
  config.profile_steps = ""
  # A device's peak TFLOP/s for the MFU; 0 takes it from the device kind (TPU v4, v5e, v5p,
  # v6e; NVIDIA A100, H100, H200).
  config.peak_tflops = 0.0
  return config
