"""The config around Hydra: what a command line chooses, checked before Hydra composes (`group_choices`,
`overrides`), the resolvers the YAML files call (`resolvers`, `grad_accumulation`), and the typed keys
of the composed config, checked before any work (`validation`); and the config composed outside
``train.py`` for commands that build a run's objects without running it (`compose`).

Above the backends whose options it checks and below the pipeline that runs the config. Nothing here
loads torch at import: ``import attnlab`` registers the resolvers before Hydra starts.
"""
