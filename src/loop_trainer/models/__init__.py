"""Models the command-line tools build or find, beside the trainer (which takes any model): ``tiny:<env>``
models made from a config (:mod:`.tiny`), ``packaged:<model>`` pretrained models shipped inside a PyPI
package (:mod:`.packaged`), and the per-GPU memory plan of ``loop-train --dry-run`` (:mod:`.memory_plan`,
over the model shapes of :mod:`.model_shape`: a config.json's, or those of the paper's models in ``shapes/``)."""
