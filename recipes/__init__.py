"""Training recipes on jaxring: ResNet-50 v1.5 on ImageNet and a small config that runs on a CPU.

Each recipe is one file with ``get_config()`` and ``main()`` (``python -m recipes.<name>``); the
logic lives in ``models``, ``optim``, ``input_pipeline`` and ``train``.
"""
