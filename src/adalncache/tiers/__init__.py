"""The tiers below the device slab: host memory (:mod:`.host`) and a persistent store (:mod:`.store`)."""
