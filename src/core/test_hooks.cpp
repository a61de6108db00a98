// The test-only fault hooks (vitgrid/core/test_hooks.h): no fault unless a test sets one.
#include "vitgrid/core/test_hooks.h"

extern "C" {
struct vitgrid_test_hooks_t vitgrid_test_hooks = {-1, -1, -1, 0, 0, 0, 0};
}
