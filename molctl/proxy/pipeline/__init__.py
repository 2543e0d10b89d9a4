"""The request pipeline: prepare -> load -> route -> answer -> record -> summary (see `run`)."""
