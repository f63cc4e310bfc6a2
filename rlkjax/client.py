"""A small synchronous client for a `python -m serve.rollout` server (the learner and benchmarks use it).

With a server's `url` ("http://127.0.0.1:8000") and its `admin_key`, and a `checkpoint` directory of the
served model's shapes:

    >>> from rlkjax import SamplingParams
    >>> client = RolloutClient(url, admin_key=admin_key)
    >>> client.wait_until_ready()["status"]  # through the server's start-up
    'ok'
    >>> results = client.generate([[1, 2, 3]], n=4, max_tokens=8, temperature=1.0, seed=0)
    >>> sample = results[0][3]  # sample 3 of prompt 0: its tokens and their logprobs, the sampler's float32 bits
    >>> len(results[0]), len(sample["tokens"]) == len(sample["logprobs"]), sample["logprobs"].dtype
    (4, True, dtype('float32'))
    >>> samples = client.generate_tokens([1, 2, 3], SamplingParams(n=2, max_tokens=8), seed=0)  # vLLM's token route
    >>> len(samples), sorted(samples[0])
    (2, ['finish_reason', 'logprobs', 'policy_version', 'tokens'])
    >>> client.update_weights(checkpoint)  # -> the new policy version
    1
"""

import json
import time
import urllib.error
import urllib.request

import numpy as np


class RolloutError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class RolloutClient:
    def __init__(self, url: str, admin_key: str | None = None, timeout: float = 3600.0):
        self.url, self.admin_key, self.timeout = url.rstrip("/"), admin_key, timeout

    def _call(self, method: str, path: str, body: dict | None = None, auth: bool = False):
        headers = {"Content-Type": "application/json"}
        if auth and self.admin_key:
            headers["Authorization"] = f"Bearer {self.admin_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise RolloutError(e.code, text) from None
        return payload if path == "/metrics" else json.loads(payload)

    def generate(
        self,
        prompts,
        *,
        n=1,
        max_tokens=None,
        temperature=1.0,
        seed=None,
        stop_token_ids=(),
        ignore_eos=False,
        max_new_tokens=None,
    ):
        """POST /generate. prompts: list of token-id lists; max_tokens (also accepted as max_new_tokens,
        the route's name for it; default 16); seed: an int, one per prompt, or None (the server draws one).
        A sampled eos (the server's tokenizer's) ends a sample, unless ignore_eos. Returns, per prompt,
        n samples with logprobs as float32 arrays."""
        if max_tokens is not None and max_new_tokens is not None:
            raise ValueError("give max_tokens or max_new_tokens (its earlier name), not both")
        max_tokens = max_tokens if max_tokens is not None else 16 if max_new_tokens is None else max_new_tokens
        out = self._call(
            "POST",
            "/generate",
            {
                "prompt": [list(map(int, p)) for p in prompts],
                "n": n,
                "max_new_tokens": max_tokens,  # the route's name for max_tokens
                "temperature": temperature,
                "seed": seed,
                "stop_token_ids": list(stop_token_ids),
                "ignore_eos": ignore_eos,
            },
        )
        for samples in out["results"]:
            for s in samples:
                s["logprobs"] = np.asarray(s["logprobs"], np.float64).astype(
                    np.float32
                )  # exact: they are float32 values
        return out["results"]

    def generate_tokens(self, prompt, sampling, seed: int) -> list[dict]:
        """One request through vLLM's token route (/inference/v1/generate): prompt token ids and an
        rlkjax SamplingParams (its n, max_tokens, temperature, stop_token_ids, ignore_eos) -> its n samples, each
        {tokens, logprobs (float32), policy_version, finish_reason}, as `generate` gives them."""
        params = dict(n=sampling.n, max_tokens=sampling.max_tokens, temperature=sampling.temperature, seed=seed)
        params |= dict(stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos, logprobs=0)
        out = self._call(
            "POST", "/inference/v1/generate", {"token_ids": list(map(int, prompt)), "sampling_params": params}
        )
        return [
            {
                "tokens": c["token_ids"],
                # exact: JSON doubles written from float32 values
                "logprobs": np.asarray([t["logprob"] for t in c["logprobs"]["content"]], np.float64).astype(np.float32),
                "policy_version": c["policy_version"],
                "finish_reason": c["finish_reason"],
            }
            for c in out["choices"]
        ]

    def prefix_cache(self) -> dict:
        """The server's prefix-cache counters from /metrics: query_tokens (prompt positions admitted after a
        lookup) and hit_tokens (those the cache held: prefill saved)."""
        served = self.counters()
        return {k: int(served[f"prefix_cache_{k}_total"]) for k in ("query_tokens", "hit_tokens")}

    def counters(self) -> dict[str, float]:
        """Every value of /metrics by its name less the rlkjax_ prefix (e.g. preemptions_total)."""
        values = {}
        for line in self.metrics().splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("rlkjax_"):
                values[name.removeprefix("rlkjax_")] = float(value)
        return values

    def update_weights(self, path: str) -> int:
        return self._call("POST", "/update_weights", {"path": str(path)}, auth=True)["policy_version"]

    def load_lora_adapter(self, name: str, path: str) -> int:
        """POST /v1/load_lora_adapter (vLLM's body): serve the PEFT adapter at `path` from now on -> policy_version."""
        body = {"lora_name": name, "lora_path": str(path)}
        return self._call("POST", "/v1/load_lora_adapter", body, auth=True)["policy_version"]

    def health(self) -> dict:
        return self._call("GET", "/health")

    def wait_until_ready(self, timeout: float = 3600.0, poll_s: float = 1.0) -> dict:
        """/health's answer once the server is ready, waiting while it is not listening yet or answers
        503 (starting: compiling its warm-up shapes). Raises the last error after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.health()
            except (OSError, RolloutError) as e:
                if (isinstance(e, RolloutError) and e.status != 503) or time.monotonic() > deadline:
                    raise
            time.sleep(poll_s)

    def metrics(self) -> str:
        return self._call("GET", "/metrics").decode()
