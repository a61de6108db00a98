// prepare_images_reference against hand-worked values: RandomCrop(padding) with zero padding,
// flip after the crop, ToTensor, Normalize, Mixup.
#include <gtest/gtest.h>

#include <vector>

#include "vitgrid/data/dataset.h"

using vitgrid::SampleAug;

namespace {

const float kMean[3] = {0.5f, 0.25f, 0.125f};
const float kStd[3] = {0.5f, 0.2f, 0.25f};

// 4x4 test image: value 10 * (y * 4 + x) + c at (y, x, c).
std::vector<uint8_t> ramp() {
  std::vector<uint8_t> v(4 * 4 * 3);
  for (int y = 0; y < 4; ++y)
    for (int x = 0; x < 4; ++x)
      for (int c = 0; c < 3; ++c) v[(y * 4 + x) * 3 + c] = (uint8_t)(10 * (y * 4 + x) + c);
  return v;
}

float norm(int byte, int c) { return (byte / 255.0f - kMean[c]) / kStd[c]; }

}  // namespace

// pad 1, crop offset (dx 0, dy 2) into the 6x6 padded image, then flip: output (y, x) is
// original (y + 1, 2 - x), worked out by hand below (P = a padded, black pixel).
TEST(PrepareImages, CropPadFlipByHand) {
  auto img = ramp();
  SampleAug a;
  a.dx = 0;
  a.dy = 2;
  a.flip = 1;
  const int P = -1;
  const int want[16] = {60, 50, 40, P,  //
                        100, 90, 80, P,  //
                        140, 130, 120, P,  //
                        P, P, P, P};
  std::vector<float> out(3 * 16, 123.0f);
  vitgrid::prepare_images_reference(out.data(), img.data(), nullptr, &a, 1, 4, 1, kMean, kStd);
  for (int c = 0; c < 3; ++c)
    for (int p = 0; p < 16; ++p) {
      float expect = want[p] == P ? (0.0f - kMean[c]) / kStd[c] : norm(want[p] + c, c);
      EXPECT_FLOAT_EQ(out[c * 16 + p], expect) << "c " << c << " pixel " << p;
    }
}

// no flip, offset (2, 1): output (y, x) is original (y, x + 1), column 3 padded.
TEST(PrepareImages, CropWithoutFlip) {
  auto img = ramp();
  SampleAug a;
  a.dx = 2;
  a.dy = 1;
  std::vector<float> out(48);
  vitgrid::prepare_images_reference(out.data(), img.data(), nullptr, &a, 1, 4, 1, kMean, kStd);
  EXPECT_FLOAT_EQ(out[0 * 4 + 0], norm(10, 0));       // (0,0) <- (0,1)
  EXPECT_FLOAT_EQ(out[16 + 2 * 4 + 2], norm(110 + 1, 1));  // G at (2,2) <- (2,3)
  EXPECT_FLOAT_EQ(out[32 + 1 * 4 + 3], -kMean[2] / kStd[2]);  // padded column
}

// The centre crop (dx = dy = pad, no flip) is the original image: what eval batches use.
TEST(PrepareImages, CentreIsIdentityAndBatchesAreIndependent) {
  auto img = ramp();
  std::vector<uint8_t> two(img);
  for (auto v : img) two.push_back((uint8_t)(255 - v));
  SampleAug a[2];
  a[0].dx = a[0].dy = 3;
  a[1].dx = a[1].dy = 3;
  std::vector<float> out(2 * 48);
  vitgrid::prepare_images_reference(out.data(), two.data(), nullptr, a, 2, 4, 3, kMean, kStd);
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < 3; ++c)
      for (int p = 0; p < 16; ++p)
        EXPECT_FLOAT_EQ(out[i * 48 + c * 16 + p], norm(two[i * 48 + p * 3 + c], c));
}

// Mixup: lam * img + (1 - lam) * partner, the partner cropped and flipped the same way (its
// padded pixels are black too).
TEST(PrepareImages, MixupBlendsWithSameCrop) {
  auto img = ramp();
  std::vector<uint8_t> partner(48, 200);
  SampleAug a;
  a.dx = 0;
  a.dy = 2;
  a.flip = 1;
  a.lam = 0.25f;
  std::vector<float> out(48);
  vitgrid::prepare_images_reference(out.data(), img.data(), partner.data(), &a, 1, 4, 1, kMean, kStd);
  for (int c = 0; c < 3; ++c) {
    float pad = -kMean[c] / kStd[c];
    // (0,0) <- original (1,2) for both images
    EXPECT_NEAR(out[c * 16 + 0], 0.25f * norm(60 + c, c) + 0.75f * norm(200, c), 1e-6);
    // (3,3) padded in both
    EXPECT_NEAR(out[c * 16 + 15], pad, 1e-6);
  }
  // lam = 1 ignores the partner exactly
  a.lam = 1.0f;
  std::vector<float> alone(48), with(48);
  vitgrid::prepare_images_reference(alone.data(), img.data(), nullptr, &a, 1, 4, 1, kMean, kStd);
  vitgrid::prepare_images_reference(with.data(), img.data(), partner.data(), &a, 1, 4, 1, kMean, kStd);
  EXPECT_EQ(alone, with);
}
