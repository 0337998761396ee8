import subprocess
import sys
import textwrap


def test_loading_never_holds_the_model_twice(tmp_path):
    """Peak RSS while loading stays well under twice the model's size."""
    script = textwrap.dedent(f"""
        import resource, torch
        from moemesh.shared.checkpoint.writer import init_model
        from moemesh.shared.model.config import ModelConfig
        d = init_model({str(tmp_path / 'm')!r}, "tiny", num_layers=3, seed=0)
        import json
        raw = json.loads(open(d / "config.json").read())
        raw.update(hidden_size=512, intermediate_size=2048, moe_intermediate_size=512, n_routed_experts=16,
                   vocab_size=1024)
        (d / "config.json").write_text(json.dumps(raw))
        for f in d.glob("*.safetensors"):
            f.unlink()
        from moemesh.shared.checkpoint import writer
        cfg = ModelConfig.from_dict(raw)
        from safetensors.torch import save_file
        tensors = {{n: writer._materialise(n, s, cfg, 0, torch.float32) for n, s in writer._hf_tensors(cfg)}}
        save_file(tensors, str(d / "model.safetensors"))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        import gc; gc.collect()
        print(size)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    size = int(out.stdout.split()[-1])
    load = textwrap.dedent(f"""
        import resource, torch
        from moemesh.shared.checkpoint.loader import load_model
        from moemesh.shared.model.config import ModelConfig
        from moemesh.shared.model.deepseek import DeepseekForCausalLM
        # The first meta-device construction imports ~150 MB of torch internals; do it
        # before the baseline so only the weights are measured.
        with torch.device("meta"):
            DeepseekForCausalLM(ModelConfig.from_dir({str(tmp_path / 'm')!r}))
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        m = load_model({str(tmp_path / 'm')!r})
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(base, peak)
    """)
    out = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    base, peak = (int(x) for x in out.stdout.split()[-2:])
    assert size > 100 << 20
    assert peak - base < 1.25 * size, (peak - base, size)
