/* loss.h: what the loss families (loss, distill) share on the host. */
#ifndef GP_LOSS_H
#define GP_LOSS_H
#include "../src/internal.h"

/* every targets[n] in [0, V) of logits (N, V) or equal to ign; else an error naming op, the row and the shapes */
int gp_loss_check_targets(const char *op, const gp_tensor *targets, const gp_tensor *logits, int64_t ign);
#endif
