"""Our own model code: the lean decoder (``decoder``: the layer loop; ``family``: what each family's checkpoint
becomes at load; ``qk_split``: a layer's q/k/v split, norms and RoPE; ``layout``: where a step's rows go and what
they attend), its MoE and Linear layers, int8 (``quantize``), checkpoint reading, what a family's config means
(``family_config``) and what the lean path implements of it (``support``), and vision-language towers and
processors (``vision``).

May import: ``types``, ``handler.errors``, ``handler.knobs`` (its kernels' environment knobs) and
``handler.start_cache``. Nothing else of the engine: the model knows neither requests nor backends. Never
``handler.config``: what it needs of the settings its caller (``lean.load``) passes in as arguments."""
