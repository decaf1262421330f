"""What a plan makes of a training step, as pure data: each rank's program (`programs`, from the
builders told each task, `task_events`, once per class of alike ranks, `rank_classes`, in the
order every rank shares, `order`, with updates fused into their gradients' kernels,
`update_fusion`), its buffers placed in one arena (`buffers`), and the predictions made from
them: the step simulated (`simulator`, and its compiled loop, `compiled`, `loop` and
`loop_cpu`, over the prices its messages see, `links`, with the CPU the network stack takes
and the messages held back while kernels run, `rank_cpu`, and pieces priced as they run,
`piece_modes`, both reporting a `simulated_step`), each rank's memory (`memory`), and both kept per plan
(`model`, `prediction`). The executor runs these programs (`runtime.rank_step`); nothing here
runs a kernel or sends a byte.
"""
