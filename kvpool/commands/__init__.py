"""The ``kvpool`` command line: ``main`` (the entry point and its table of subcommand modules) and the
application's own subcommands (``up``, ``status``, ``chaos``, ``verify``, ``demo``, and ``worker`` for
``kvpool prefill|decode``). Each module parses its flags and calls into ``kvpool.launch`` or the layers below;
the store's, model's, gateway's and workloads' subcommands live in their own packages' ``cli`` modules."""
