"""``jaxring simulate``: a training step's time at scales no one can run here, from the cost model.

``model`` gives a network's layers (parameters and FLOPs), ``cluster`` the machines (GPUs per
node, link rates, compute rate), ``timeline`` one data-parallel step: backward layer by layer,
gradients filling buckets in backward order, each bucket reduced by a plan (the alpha-beta
formulas of ``jaxring._src.cost_model``) once it is full, overlapped with the rest of backprop.
"""
