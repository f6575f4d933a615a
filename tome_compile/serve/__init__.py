"""``tome-serve``: the project's text-to-image pipeline served on Ray Serve (``pip install
tome-compile[serve]``).

* :mod:`.request` — what ``POST /generate`` may ask for (limits, 422 messages); no Ray;
* :mod:`.engine` — what a replica runs: the model, a denoiser per served ratio, batched loops
  whose pictures do not depend on their batch; no Ray (the offline reference of a served picture);
* :mod:`.app` — the Serve deployments (HTTP front, model replicas with ``@serve.batch``) and the
  application builder for ``serve run`` / Serve config files;
* :mod:`.cli` — the ``tome-serve`` command; :mod:`.bench` — the load benchmark.
"""
